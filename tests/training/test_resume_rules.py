"""Which checkpoint a run starts from (transformer/training/launcher.py `restore`), in process: trainer.resume=PATH
only starts a line of training, so the same command again (a Slurm requeue, a torchrun restart) goes on from the
newest checkpoint the run directory holds since, not from PATH; a rewind to an earlier file keeps its new files
(keep-last-K once deleted each one right after writing it) and removes the abandoned line's later ones. And
trainer.init_from takes the weights that were validated: the weight average where the checkpoint has one."""
import logging

import torch

from tests.training.loop.test_trainer import make_trainer
from transformer.dist import DistEnv
from transformer.training.components.checkpoint import Checkpointer
from transformer.training.launcher import restore


def saved(t, step: int) -> None:
    """`t` at `step`, checkpointed into its own run directory."""
    t.step = step
    t.checkpointer.folder.parent.mkdir(parents=True, exist_ok=True)
    t.checkpointer.save(t.state_dict(), step, is_best=False)


def started(run, *overrides, seed_model: int = 0):
    t = make_trainer(run, *overrides, seed_model=seed_model)
    restore(t, t.cfg, DistEnv())
    return t


def steps(run) -> list:
    return [s for s, _ in Checkpointer(run, 1).step_files()]


def test_a_requeue_of_a_run_started_from_path_goes_on_from_its_own_newest_checkpoint(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="transformer")
    saved(make_trainer(tmp_path / "src"), 4)
    path = tmp_path / "src" / "checkpoints" / "step_00000004.pt"
    run, resume = tmp_path / "run", f"trainer.resume={path}"
    first = started(run, resume)
    assert first.step == 4
    first_log = caplog.text
    saved(first, 6)
    saved(first, 8)
    caplog.clear()
    again = started(run, resume)  # the same command: the requeue
    assert again.step == 8, caplog.text
    assert f"step 4 (epoch 0, batch 0): trainer.resume={path}; the run directory holds no checkpoint yet" in first_log
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert line.startswith(f"resumed from {run / 'checkpoints' / 'step_00000008.pt'} at step 8 ")
    assert f"newer than trainer.resume={path} (step 4)" in line


def test_keep_last_never_deletes_the_file_just_written_and_removes_an_abandoned_lines_later_ones(tmp_path, caplog):
    t = make_trainer(tmp_path)
    ck = Checkpointer(tmp_path, keep_last=3)
    state = t.state_dict()
    for step in (10, 20, 30):
        ck.save(state, step, False)
    path = ck.save(state, 15, False)  # a run that went back to step 10 and on
    assert path.is_file() and [s for s, _ in ck.step_files()] == [15, 10]
    assert (tmp_path / "checkpoints" / "last.pt").samefile(path)
    assert "removed step_00000020.pt, step_00000030.pt: checkpoints after step 15" in caplog.text


def test_a_rewind_inside_the_run_directory_takes_path_and_its_requeue_its_own_newest(tmp_path, caplog):
    """PATH may be a file of this run directory: its later files are the abandoned line's, not the run's own."""
    caplog.set_level(logging.INFO, logger="transformer")
    run = tmp_path / "run"
    t = make_trainer(run, "checkpoint.keep_last=3")
    for step in (2, 4, 6):
        saved(t, step)
    path = run / "checkpoints" / "step_00000002.pt"
    resume = (f"trainer.resume={path}", "checkpoint.keep_last=1")
    first = started(run, *resume)
    assert first.step == 2, caplog.text
    assert "step_00000006.pt (step 6) was not trained from it" in caplog.text
    assert "holds checkpoints after step 2, of another line of training than this run's (step_00000004.pt, " \
           "step_00000006.pt): this run's first checkpoint removes them" in caplog.text
    assert [s for s, _ in first.checkpointer.step_files()] == [2]  # not its last checkpoint, nor averaged
    saved(first, 3)
    saved(first, 5)
    # its own newest file kept (keep_last=1), and PATH, which every rerun names; the abandoned 4 and 6 removed
    assert steps(run) == [5, 2]
    caplog.clear()
    assert started(run, *resume).step == 5, caplog.text  # the requeue
    assert "newer than trainer.resume=" in caplog.text


def test_a_path_into_a_run_directory_holding_another_lines_checkpoints_is_taken(tmp_path):
    saved(make_trainer(tmp_path / "src"), 4)
    path = tmp_path / "src" / "checkpoints" / "step_00000004.pt"
    saved(make_trainer(tmp_path / "run"), 8)  # a run directory reused for another line
    t = started(tmp_path / "run", f"trainer.resume={path}")
    assert t.step == 4
    saved(t, 5)
    assert steps(tmp_path / "run") == [5]  # its own, not step 8 of the other line
    assert started(tmp_path / "run", f"trainer.resume={path}").step == 5


def test_init_from_takes_the_weight_average_that_validation_scored(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="transformer")
    base = make_trainer(tmp_path / "base", "trainer.ema_decay=0.9")
    for v in base.ema.shadow.values():
        v.add_(0.5)  # the average and the trained weights differ
    saved(base, 3)
    path = tmp_path / "base" / "checkpoints" / "step_00000003.pt"
    for ema in ("trainer.ema_decay=0", "trainer.ema_decay=0.99"):
        tuned = started(tmp_path / ema, f"trainer.init_from={path}", ema, seed_model=1)
        weights = tuned.model.state_dict()
        for k, v in base.ema.shadow.items():
            assert torch.equal(weights[k], v), k
        if tuned.ema is not None:  # a new average starts from them, not from the random initial weights
            assert all(torch.equal(tuned.ema.shadow[k], v) for k, v in base.ema.shadow.items())
    assert "initialised weights and tokenizer from" in caplog.text and "its weight average" in caplog.text
    plain = make_trainer(tmp_path / "plain")
    saved(plain, 3)
    caplog.clear()
    tuned = started(tmp_path / "p2", f"trainer.init_from={tmp_path / 'plain' / 'checkpoints' / 'step_00000003.pt'}",
                    seed_model=1)
    assert all(torch.equal(tuned.model.state_dict()[k], v) for k, v in plain.model.state_dict().items())
    assert "(its trained weights)" in caplog.text
