"""eval.tune_lenpen: the length penalty chosen on validation at the end of training, stored in best.pt and
applied by transformer-evaluate/translate unless --lenpen is given."""
import json
import subprocess
from dataclasses import replace

import pytest

from tests.cli.test_evaluate import fake_data
from tests.helpers.cli import cli_env, compose_cfg, train_cmd
from tests.helpers.dist import TINY
from tests.helpers.models import copy_checkpoint, copy_model, one_thread  # noqa: F401
from transformer.cli.common import eval_config
from transformer.cli.evaluate import build_parser
from transformer.cli.evaluate import main as evaluate
from transformer.config import ConfigError, EvalConfig
from transformer.config_checks import validate
from transformer.dist import DistEnv
from transformer.tasks import translation
from transformer.training.components.checkpoint import FORMAT, Checkpointer, load_checkpoint
from transformer.training.loop import run_end


def test_each_value_is_scored_as_valid_bleu_scores_it():
    data, ev = fake_data(24), EvalConfig(beam=3)
    got = translation.tune_lenpen(copy_model(), data, DistEnv(), ev, [0.0, 1.0, 2.5])
    for x in (0.0, 1.0, 2.5):
        want = translation.valid_bleu(copy_model(), data, DistEnv(), replace(ev, lenpen=x))["val_bleu"]
        assert got[f"val_bleu_lenpen{x:g}"] == pytest.approx(want)
    assert got["lenpen"] in (0.0, 1.0, 2.5)


@pytest.mark.parametrize("by_lenpen,chosen", [
    ({1.0: 40.0, 1.2: 41.5, 1.4: 41.0}, 1.2),
    ({1.0: 41.0, 1.2: 41.0, 1.4: 40.0}, 1.0),  # a tie keeps the earlier value (the recipe lists its default first)
    ({1.4: 39.0, 1.0: 39.0}, 1.4),
])
def test_the_best_bleu_wins_and_a_tie_keeps_the_first(monkeypatch, by_lenpen, chosen):
    monkeypatch.setattr(translation, "valid_bleu", lambda model, data, env, ev: {"val_bleu": by_lenpen[ev.lenpen]})
    got = translation.tune_lenpen(None, None, DistEnv(), EvalConfig(), list(by_lenpen))
    assert got["lenpen"] == chosen


@pytest.mark.parametrize("valid_beam,want_beam", [(None, 5), (1, 1), (3, 3)])
def test_validation_decodes_with_valid_beam_and_tuning_with_beam(monkeypatch, valid_beam, want_beam):
    seen = []
    monkeypatch.setattr(translation, "valid_bleu", lambda model, data, env, ev: seen.append(ev) or {"val_bleu": 1.0})
    cfg = compose_cfg("experiment=multi30k", f"eval.valid_beam={'null' if valid_beam is None else valid_beam}",
                      "eval.nbest=2")
    task = translation.TranslationTask(cfg)
    task.validate(None, None, DistEnv())
    assert (seen[0].beam, seen[0].nbest) == (want_beam, 1 if valid_beam is not None else 2)
    task.tune(None, None, DistEnv())  # the length penalty is chosen with the evaluation's beam
    assert {ev.beam for ev in seen[1:]} == {5} and len(seen) == 1 + len(cfg.eval.tune_lenpen)


@pytest.mark.parametrize("overrides,message", [
    (["eval.valid_beam=0"], "eval.valid_beam=0: must be >= 1 or null"),
    (["eval.tune_lenpen=[1.0,nan]"], "eval.tune_lenpen=[1.0, nan]: must be finite numbers"),
    (["eval.tune_lenpen=[1.0,1.0]"], "eval.tune_lenpen=[1.0, 1.0]: has a value twice"),
    (["eval.tune_lenpen=[1.0]", "eval.bleu=false"], "eval.tune_lenpen=[1.0]: ranks by validation BLEU"),
])
def test_bad_grids_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(compose_cfg("experiment=multi30k", *overrides))


def test_the_command_applies_the_stored_lenpen_unless_given():
    ckpt = copy_checkpoint()
    ckpt["decoding"] = {"lenpen": 1.4}
    parser = build_parser()
    assert eval_config(parser.parse_args(["x.pt", "--src", "a"]), ckpt).lenpen == 1.4
    assert eval_config(parser.parse_args(["x.pt", "--src", "a", "--lenpen", "0.6"]), ckpt).lenpen == 0.6
    del ckpt["decoding"]
    assert eval_config(parser.parse_args(["x.pt", "--src", "a"]), ckpt).lenpen == EvalConfig().lenpen


@pytest.mark.parametrize("best_step,steps", [(2, (1, 2)), (1, (1, 2)), (1, (1, 2, 3))],
                         ids=["best_is_last", "best_is_older", "best_rotated_out"])
def test_the_choice_reaches_every_name_of_the_best_file(tmp_path, best_step, steps):
    """best.pt (and last.pt, when they are the same state) are hard links: after the rewrite each still
    shares the step file it shared (a best.pt whose step file was rotated out is rewritten on its own)."""
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    for step in steps:
        checkpointer.save({"format": FORMAT, "model": {}, "step": step}, step, is_best=step == best_step)
    folder = checkpointer.folder
    shared = {p.name for p in folder.glob("*.pt") if p.samefile(folder / "best.pt")}
    tuned = {"lenpen": 1.2, "val_bleu_lenpen1.0": 40.0, "val_bleu_lenpen1.2": 41.0}
    run_end._store_decoding(checkpointer, folder / "best.pt", load_checkpoint(folder / "best.pt"), tuned)
    assert {p.name for p in folder.glob("*.pt") if p.samefile(folder / "best.pt")} == shared
    for name in shared:
        ckpt = load_checkpoint(folder / name)
        assert ckpt["step"] == best_step
        assert ckpt["decoding"] == {"lenpen": 1.2, "chosen_on": "validation BLEU",
                                    "val_bleu": {"val_bleu_lenpen1.0": 40.0, "val_bleu_lenpen1.2": 41.0}}
    assert all("decoding" not in load_checkpoint(p) for p in folder.glob("*.pt") if p.name not in shared)


@pytest.mark.slow
def test_training_stores_the_choice_in_best_pt_and_evaluate_decodes_with_it(tmp_path):
    """A tiny translation run (a word-for-word corpus) with checkpoint.average_last: the choice is logged
    (split "tune"), written into the file best.pt links to (best.pt still shares it), and used by
    transformer-evaluate, whose default would otherwise be the config's lenpen 1.0."""
    words = "ein zwei drei vier fünf sechs sieben acht".split()
    english = dict(zip(words, "one two three four five six seven eight".split(), strict=True))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, n, seed in (("train", 300, 1), ("val", 20, 2)):
        lines = [[words[(i * seed + j * 3) % 8] for j in range(2 + (i % 5))] for i in range(n)]
        (corpus / f"{split}.de").write_text("".join(" ".join(s) + "\n" for s in lines), encoding="utf-8")
        (corpus / f"{split}.en").write_text("".join(" ".join(english[w] for w in s) + "\n" for s in lines),
                                            encoding="utf-8")
    run_dir = tmp_path / "run"
    overrides = ["data=files", f"data.files.train={corpus}/train", f"data.files.val={corpus}/val",
                 "tokenizer=spacy", *TINY[4:], "trainer.max_steps=6", "checkpoint.every_steps=2",
                 "checkpoint.average_last=2", "checkpoint.best_metric=val_bleu", "eval.tune_lenpen=[1.3,0.7]",
                 f"hydra.run.dir={run_dir}"]
    r = subprocess.run(train_cmd(*overrides), cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tune = [rec for rec in records if rec["split"] == "tune"]
    assert len(tune) == 1 and {"val_bleu_lenpen1.3", "val_bleu_lenpen0.7"} <= tune[0].keys()
    folder = run_dir / "checkpoints"
    best = load_checkpoint(folder / "best.pt")
    assert best["decoding"]["lenpen"] == tune[0]["lenpen"] in (1.3, 0.7)
    assert evaluate([str(folder / "best.pt"), "--src", f"{corpus}/val.de", "--ref", f"{corpus}/val.en",
                     "--out-dir", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "val.de.json").read_text())["lenpen"] == tune[0]["lenpen"]
