"""Resuming is exact: a run cut by `trainer.max_steps` and rerun in the same directory ends bit-identical
(torch.equal on every tensor, optimiser moments and RNG states included) to one that never stopped, with
dropout on so the restored RNG states matter. Also: a truncated newest checkpoint is skipped with a
warning, and a checkpoint of another world size is refused with a clear message.

Every test here trains through the real CLI, so they are slow; the 2-worker ones are also distributed.
"""
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.dist import assert_same_state, last_ckpt, step_files, train

pytestmark = pytest.mark.slow

DROPOUT = ("model.dropout=0.1",)
# One worker: 6 steps an epoch (640 examples in 6 batches). Validating every 3 steps puts a validation on
# the epoch boundary at step 6, where the trainer used to validate twice.
ONE = (*DROPOUT, "trainer.max_steps=9", "trainer.val_every=3", "checkpoint.every_steps=100")
# Two spawned workers: 3 steps an epoch.
TWO = (*DROPOUT, "trainer.max_steps=7", "trainer.val_every=2", "checkpoint.every_steps=100",
       "trainer.devices=2", "trainer.accelerator=cpu")


@pytest.fixture(scope="module")
def ref_one(tmp_path_factory) -> Path:
    """The uninterrupted single-worker run."""
    root = tmp_path_factory.mktemp("ref_one")
    train(root / "run", *ONE, cwd=root)
    return root / "run"


@pytest.fixture(scope="module")
def ref_two(tmp_path_factory) -> Path:
    """The uninterrupted 2-worker run (spawn path)."""
    root = tmp_path_factory.mktemp("ref_two")
    train(root / "run", *TWO, cwd=root)
    return root / "run"


def resumed(tmp_path: Path, base: tuple, cut: int) -> Path:
    run = tmp_path / "run"
    train(run, *base, f"trainer.max_steps={cut}", cwd=tmp_path)
    assert last_ckpt(run)["trainer"]["step"] == cut
    res = train(run, *base, cwd=tmp_path)
    assert f"resumed from {run / 'checkpoints'}" in res.stderr and f"at step {cut}" in res.stderr
    assert "settings other than" not in res.stderr  # a longer trainer.max_steps is no change of settings
    return run


@pytest.mark.parametrize("cut", [4, 6], ids=["mid_epoch", "epoch_boundary"])
def test_resume_single_worker_is_bit_exact(tmp_path, ref_one, cut):
    run = resumed(tmp_path, ONE, cut)
    ref = last_ckpt(ref_one)
    assert ref["trainer"]["step"] == 9 and ref["trainer"]["epoch"] == 1  # the run crossed an epoch boundary
    assert_same_state(last_ckpt(run), ref)


def test_resume_with_a_weight_average_is_bit_exact(tmp_path):
    """trainer.ema_decay: the average is in the checkpoint and continues exactly; validation scored it."""
    ema = (*ONE, "trainer.ema_decay=0.9")
    ref = tmp_path / "ref"
    train(ref / "run", *ema, cwd=ref.mkdir() or ref)
    run = resumed(tmp_path, ema, 4)
    a, b = last_ckpt(run), last_ckpt(ref / "run")
    assert b["ema"]["updates"] == 9
    assert_same_state(a, b)


@pytest.mark.distributed
@pytest.mark.parametrize("cut", [4, 3], ids=["mid_epoch", "epoch_boundary"])
def test_resume_two_workers_is_bit_exact(tmp_path, ref_two, cut):
    run = resumed(tmp_path, TWO, cut)
    ref = last_ckpt(ref_two)
    assert len(ref["rng"]) == 2 and not all(ref["rng"][0]["cpu"].equal(r["cpu"]) for r in ref["rng"][1:])
    assert_same_state(last_ckpt(run), ref)


def test_resume_validates_each_step_once(ref_one):
    """An epoch ending on a val_every step is validated once: a second, equal score would count as a
    validation without improvement and could trip early stopping (eval.patience)."""
    events = [json.loads(line) for line in (ref_one / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["split"] == "valid"]
    assert steps == [3, 6, 9], steps


def test_resume_skips_truncated_checkpoint(tmp_path, ref_one):
    """The newest step file cut short (as by a full disk on a file system without atomic rename) is
    skipped with a warning; training resumes from the one before and still ends bit-identical."""
    run = tmp_path / "run"
    train(run, *ONE, "trainer.max_steps=5", "checkpoint.every_steps=2", cwd=tmp_path)
    newest = step_files(run)[-1]
    assert newest.name == "step_00000005.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # last.pt is a hard link to it: truncated as well
    assert (run / "checkpoints" / "last.pt").stat().st_size == len(data) // 2
    res = train(run, *ONE, "checkpoint.every_steps=2", cwd=tmp_path)
    assert "skipping corrupt checkpoint" in res.stderr and "step_00000005.pt" in res.stderr
    assert "at step 4" in res.stderr
    assert_same_state(last_ckpt(run), last_ckpt(ref_one))


def test_resume_with_other_settings_names_them(tmp_path, ref_one):
    """Rerunning an ended run's directory with other overrides (another seed, say) resumes it; one warning
    names each changed key with both values, so a run that looks new but continues is not a surprise."""
    run = tmp_path / "run"
    shutil.copytree(ref_one, run)
    res = train(run, *ONE, "seed=7", "trainer.max_steps=10", "eval.beam=2", cwd=tmp_path)
    warned = [line for line in res.stderr.splitlines() if "settings other than" in line]
    assert len(warned) == 1, res.stderr[-3000:]
    assert "eval.beam=1 -> 2; seed=1234 -> 7." in warned[0] and "max_steps" not in warned[0]
    assert last_ckpt(run)["trainer"]["step"] == 10


@pytest.mark.distributed
def test_resume_refuses_other_world_size(tmp_path, ref_one, ref_two):
    """1 -> 2 workers (spawn path) and 2 -> 1 (plain path): a clear error, no training, nothing written."""
    for ref, devices, written, now in ((ref_one, 2, 1, 2), (ref_two, 1, 2, 1)):
        run = tmp_path / f"from_{written}"
        shutil.copytree(ref, run)
        before = {p: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
        res = train(run, *DROPOUT, "trainer.max_steps=20", f"trainer.devices={devices}", "trainer.accelerator=cpu",
                    cwd=tmp_path, expect=None)
        assert res.returncode == 2, res.stderr[-3000:]
        last_line = res.stderr.strip().splitlines()[-1]
        assert last_line.startswith("error: ") and f"was written by {written} workers but this run has {now}" \
            in last_line, res.stderr[-3000:]
        assert "trainer.init_from" in last_line  # and says what to do instead
        assert {p: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before


def test_resume_with_bpe_dropout_is_bit_exact(tmp_path):
    """data.bpe_dropout: an epoch's segmentations are a function of (seed, epoch), so a run cut mid-epoch
    goes on with the ids it would have seen (translation on a tiny corpus, two epochs)."""
    from tests.helpers.cli import train_cmd
    from tests.helpers.data import TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, write_corpus
    from tests.helpers.dist import env_for, run_cli
    corpus = tmp_path / "corpus"
    base = ("data=files", f"data.files.train={write_corpus(corpus, 'train', TRAIN_DE * 6, TRAIN_EN * 6)}",
            f"data.files.val={write_corpus(corpus, 'val', VAL_DE, VAL_EN)}", "tokenizer=bpe",
            "tokenizer.vocab_size=120", "tokenizer.min_freq=1", "data.bpe_dropout=0.3", "data.max_tokens=200",
            "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", *DROPOUT, "trainer.max_steps=11",
            "trainer.max_epochs=null", "trainer.val_every=100", "checkpoint.every_steps=100", "trainer.progress=false")
    env = env_for(XDG_CACHE_HOME=str(tmp_path / "cache"))

    def run(run_dir: Path, *extra: str):
        return run_cli(train_cmd(*base, f"hydra.run.dir={run_dir}", *extra), tmp_path, env=env)

    run(tmp_path / "ref")
    ref = last_ckpt(tmp_path / "ref")
    assert ref["trainer"]["epoch"] >= 1  # the run crossed an epoch boundary: a second epoch's segmentations
    run(tmp_path / "run", "trainer.max_steps=3")
    assert "resumed from" in run(tmp_path / "run").stderr
    assert_same_state(last_ckpt(tmp_path / "run"), ref)


def test_a_requeue_of_a_run_started_from_path_goes_on_from_its_own_checkpoint(tmp_path, ref_one):
    """trainer.resume=PATH only starts a run: the same command again (a Slurm requeue, a torchrun restart) goes
    on from the newest checkpoint the run directory holds since, not from PATH, whose later steps it would redo."""
    train(tmp_path / "src", *ONE, "trainer.max_steps=4", cwd=tmp_path)
    path = tmp_path / "src" / "checkpoints" / "step_00000004.pt"
    run, command = tmp_path / "run", (*ONE, f"trainer.resume={path}")
    first = train(run, *command, cwd=tmp_path)
    assert f"resumed from {path} at step 4" in first.stderr
    assert_same_state(last_ckpt(run), last_ckpt(ref_one))  # another run directory continues exactly too
    again = train(run, *command, cwd=tmp_path)
    own = run / "checkpoints" / "step_00000009.pt"
    assert f"resumed from {own} at step 9" in again.stderr, again.stderr[-3000:]
    assert f"newer than trainer.resume={path} (step 4)" in again.stderr
    trained = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["split"] == "train"]
    assert trained == sorted(set(trained)) and max(trained) == 9  # no step trained twice
    assert_same_state(last_ckpt(run), last_ckpt(ref_one))
