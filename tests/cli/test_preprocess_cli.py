"""`transformer-preprocess` through its real command line, and `transformer-train data.preprocessed=DIR`:
the same training, step for step, as preprocessing on the fly."""
import sys

import pytest

from tests.helpers.cli import train_cmd
from tests.helpers.data import TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, write_corpus
from tests.helpers.dist import assert_same_state, assert_same_weights, last_ckpt, run_cli
from tests.helpers.inprocess import call_main
from tests.helpers.textfiles import fifo
from transformer.data.corpus import READ_TWICE
from transformer.data.store import MANIFEST, Preprocessed

PRE = [sys.executable, "-m", "transformer.cli.preprocess"]


def corpus(tmp_path, n=96):
    """n numbered variations of the small corpus (enough for several batches an epoch)."""
    de = [f"{TRAIN_DE[i % 8][:-1]} {i % 13} ." for i in range(n)]
    en = [f"{TRAIN_EN[i % 8][:-1]} {i % 13} ." for i in range(n)]
    c = tmp_path / "corpus"
    return ["data=files", f"data.files.train={write_corpus(c, 'train', de, en)}",
            f"data.files.val={write_corpus(c, 'val', VAL_DE, VAL_EN)}", "tokenizer.min_freq=1"]


def test_preprocess_command_writes_a_verified_folder(tmp_path):
    res = run_cli([*PRE, *corpus(tmp_path), f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.workers=1",
                   "preprocess.progress=false"], tmp_path)
    assert "96 train pairs (0 skipped), 2 valid" in res.stdout and "data.preprocessed=" in res.stdout
    pre = Preprocessed(tmp_path / "bin")
    assert pre.manifest["config"]["data"]["files"]["train"].endswith("corpus/train")
    assert run_cli([*PRE, "--help"], tmp_path).stdout.startswith("usage: transformer-preprocess")


@pytest.mark.parametrize("args,message", [
    ([], r"^error: .*preprocess\.out_dir"),
    (["preprocess.out_dir=OUT", "preprocess.workerz=2"], r"^error: .*workerz"),
    (["preprocess.out_dir=OUT", "data.files.train=/nonexistent/train"], r"^error: corpus file not found: "
                                                                         r"/nonexistent/train\.de"),
    (["preprocess.out_dir=OUT", "tokenizer.name=wordpiece"], r"^error: tokenizer.name='wordpiece'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, message, capfd):
    """In this process (the command's own process: test_preprocess_command_writes_a_verified_folder, and
    test_contract.py's bad input)."""
    from transformer.cli import preprocess

    args = [a.replace("OUT", str(tmp_path / "bin")) for a in args]
    res = call_main(preprocess.main, [*corpus(tmp_path), *args, "preprocess.progress=false"], tmp_path,
                    prog="transformer-preprocess", capture=capfd)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and pytest.importorskip("re").search(message, lines[0]), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_pipe_as_corpus_is_refused_by_name(tmp_path):
    data = corpus(tmp_path)
    train_de = tmp_path / "corpus" / "train.de"
    content = train_de.read_bytes()
    train_de.unlink()
    with fifo(train_de, content, again=True):  # even a pipe that could be read again: one read is all one can count on
        res = run_cli([*PRE, *data, f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.progress=false"], tmp_path,
                      expect=2)
    assert res.stderr.strip().splitlines() == [
        f"error: data.files.train={tmp_path / 'corpus' / 'train'}: {train_de} is a pipe, which can be read only once, "
        f"and {READ_TWICE}: write it to a file first"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


TRAIN = ("model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "model.dropout=0.1", "data.max_tokens=120",
         "trainer.max_steps=6", "trainer.max_epochs=null", "trainer.val_every=100", "checkpoint.every_steps=100",
         "optim.warmup=10", "eval.bleu=false", "trainer.progress=false", "trainer.accelerator=cpu")


@pytest.mark.slow
def test_training_from_the_folder_equals_training_on_the_fly(tmp_path):
    data = corpus(tmp_path)
    run_cli([*PRE, *data, f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.progress=false"], tmp_path)
    run_cli(train_cmd(*data, *TRAIN, f"hydra.run.dir={tmp_path / 'fly'}"), tmp_path)
    run_cli(train_cmd(*data, *TRAIN, f"data.preprocessed={tmp_path / 'bin'}", f"hydra.run.dir={tmp_path / 'pre'}"),
            tmp_path)
    fly, pre = last_ckpt(tmp_path / "fly"), last_ckpt(tmp_path / "pre")
    assert fly["trainer"]["step"] == pre["trainer"]["step"] == 6
    assert_same_state(fly, pre)  # bit for bit: the same ids, batches, weights, optimiser and RNG states
    assert fly["tokenizer"] == pre["tokenizer"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_workers_from_the_folder_equal_one_accumulating(tmp_path):
    # 16 batches of 8 pairs an epoch: no batch needs splitting for 2 workers; no dropout (it differs by rank)
    data = corpus(tmp_path, n=128)
    run_cli([*PRE, *data, f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.progress=false"], tmp_path)
    pre = (*data, *TRAIN, f"data.preprocessed={tmp_path / 'bin'}", "data.max_sentences=8", "data.max_tokens=400",
           "model.dropout=0.0")
    run_cli(train_cmd(*pre, "trainer.accumulate=2", f"hydra.run.dir={tmp_path / 'acc'}"), tmp_path)
    run_cli(train_cmd(*pre, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'two'}"), tmp_path)
    acc, two = last_ckpt(tmp_path / "acc"), last_ckpt(tmp_path / "two")
    assert (acc["trainer"]["world_size"], two["trainer"]["world_size"]) == (1, 2)
    assert_same_weights(acc, two, atol=1e-6)


@pytest.mark.slow
def test_training_refuses_a_tampered_or_mismatched_folder(tmp_path):
    data = corpus(tmp_path)
    run_cli([*PRE, *data, f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.progress=false"], tmp_path)
    args = (*data, *TRAIN, f"data.preprocessed={tmp_path / 'bin'}", f"hydra.run.dir={tmp_path / 'run'}")
    res = run_cli(train_cmd(*args, "data.src_lang=en", "data.tgt_lang=de"), tmp_path, expect=2)
    assert res.stderr.strip().splitlines()[-1].startswith("error: data.preprocessed=")
    path = tmp_path / "bin" / "train.src.tokens.npy"
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    res = run_cli(train_cmd(*args), tmp_path, expect=2)
    assert res.stderr.strip().splitlines()[-1] == (f"error: {path}: sha256 differs from {MANIFEST} "
                                                    "(altered or corrupt: preprocess again)")
    assert not (tmp_path / "run").exists()
