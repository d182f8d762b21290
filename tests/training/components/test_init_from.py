"""trainer.init_from fine-tunes on another corpus with the checkpoint's tokenizer: the same word keeps its id (it
used to learn a new vocabulary of the same size, whose ids meant other words). A config asking for another
tokenizer is refused with one line naming both settings."""
from pathlib import Path

import pytest
import torch

from tests.cli.test_preprocess_cli import TRAIN
from tests.helpers.cli import compose_cfg, train_cmd
from tests.helpers.data import TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, write_corpus
from tests.helpers.dist import run_cli
from transformer import exit_codes
from transformer.data import build_data
from transformer.data.tokenizer import tokenizer_from_state
from transformer.dist import DistEnv
from transformer.tasks import build_task
from transformer.training.components.checkpoint import load_checkpoint
from transformer.training.distributed.parallelize import build_model, parallelize
from transformer.training.loop.trainer import Trainer

# No TensorBoard: its end-of-run figures (matplotlib) took a third of each run; nothing here reads them.
QUIET = ("logger.trackers=[]",)


def files_data(folder: Path, words: int) -> list:
    """A corpus of the small sentences plus `words` extra numbered words: two corpora, two vocabularies."""
    de = [f"{TRAIN_DE[i % 8][:-1]} wort{i % words} ." for i in range(64)]
    en = [f"{TRAIN_EN[i % 8][:-1]} word{i % words} ." for i in range(64)]
    return ["data=files", f"data.files.train={write_corpus(folder, 'train', de, en)}",
            f"data.files.val={write_corpus(folder, 'val', VAL_DE, VAL_EN)}", "tokenizer.min_freq=1"]


def run(tmp_path: Path, name: str, *overrides: str, expect: int = 0):
    return run_cli(train_cmd(*TRAIN, *QUIET, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / name}", *overrides),
                   tmp_path, expect=expect)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """(the first corpus's overrides, the checkpoint of a run on it): one run, read by both tests. Trained in this
    process as the launcher's worker wires it (data, model, Trainer): only the runs from it are the CLI's."""
    folder = tmp_path_factory.mktemp("init-from")
    first = files_data(folder / "c1", 5)
    cfg = compose_cfg(*TRAIN, *QUIET, "trainer.max_steps=2", *first)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices
    with pytest.MonkeyPatch.context() as mp:  # conftest's private cache is set per test, after this fixture
        mp.setenv("XDG_CACHE_HOME", str(folder / "xdg-cache"))
        try:
            data = build_data(cfg, DistEnv(), folder / "base")
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, data)
            trainer = Trainer(cfg, DistEnv(), parallelize(model, cfg, DistEnv()), data, build_task(cfg),
                              folder / "base")
            assert trainer.train() == 0
            trainer.close(0)
        finally:
            torch.set_num_threads(threads)
    return first, folder / "base" / "checkpoints" / "last.pt"


def test_init_from_keeps_the_checkpoints_tokenizer_on_another_corpus(tmp_path, base_run):
    _, path = base_run
    second = files_data(tmp_path / "c2", 11)
    base = load_checkpoint(path)
    # Fine-tuning may change P_drop (a rate, not a weight): the run starts from the weights all the same.
    run(tmp_path, "tuned", *second, f"trainer.init_from={path}",
        f"model.dropout={base['model_args']['dropout'] + 0.15}")
    tuned = load_checkpoint(tmp_path / "tuned" / "checkpoints" / "last.pt")
    assert tuned["tokenizer"] == base["tokenizer"]
    assert tuned["model_args"]["dropout"] == base["model_args"]["dropout"] + 0.15
    # What a run on the second corpus learns by itself is another vocabulary: the test can fail. (The data a run
    # builds, in this process: its tokenizer is what the run's checkpoints store.)
    fresh = {"tokenizer": build_data(compose_cfg(*TRAIN, *second), DistEnv()).tokenizer.state_dict()}
    assert fresh["tokenizer"] != base["tokenizer"]
    sentence = f"{TRAIN_DE[0][:-1]} wort3 wort9 ."
    ids = [tokenizer_from_state(ck["tokenizer"]).encode_src(sentence) for ck in (base, tuned, fresh)]
    assert ids[1] == ids[0] and ids[2] != ids[0]


def test_init_from_refuses_a_config_asking_for_another_tokenizer(tmp_path, base_run):
    data, ckpt = base_run
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run(tmp_path, "tuned", *data, "tokenizer.min_freq=2", f"trainer.init_from={ckpt}",
              expect=exit_codes.USER_ERROR)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"trainer.init_from={ckpt}" in errors[0] and "tokenizer.min_freq=2 (the checkpoint's: 1)" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # the refused run's directory is gone again
