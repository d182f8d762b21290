"""Distributed training you can trust (issue #4), on CPU with gloo over 127.0.0.1.

- 2 workers (spawned by `trainer.devices=2`, or by torchrun) equal 1 worker with `trainer.accumulate=2`;
  every example is seen once an epoch, whatever the world size;
- a stop signal (SIGTERM to the spawn parent or to the torchrun agent) checkpoints and exits with code 3,
  and the rerun ends bit-identical to a run that was never stopped;
- a SIGKILLed worker: torchrun --max-restarts=1 restarts and still ends bit-identical; on the spawn path
  the others come down with a clear error (no hang) and rerunning continues;
- two torchrun agents (--nnodes=2) form one 4-rank job; only global rank 0 writes, into one run directory.
"""
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.cli import compose_cfg, train_cmd
from tests.helpers.dist import (
    TINY,
    assert_same_state,
    assert_same_weights,
    env_for,
    files_under,
    finish,
    free_port,
    last_ckpt,
    popen,
    run_cli,
    spawned_workers,
    step_files,
    torchrun,
    torchrun_cmd,
    torchrun_workers,
    train,
    wait_for,
)
from transformer.data.copy import CopyData
from transformer.data.sampler import TokenBatchSampler
from transformer.model import Transformer

SPAWN2 = ("trainer.devices=2", "trainer.accelerator=cpu")
CPU = ("trainer.accelerator=cpu",)  # torchrun: gloo on CPU even where GPUs are visible
# Long enough (80 steps, 30 an epoch with 2 workers) to be stopped in the middle; dropout on, so the
# RNG states of both ranks must be restored for the resumed run to match.
LONG = ("model.dropout=0.1", "data.copy.train_size=6400", "trainer.max_steps=80", "trainer.val_every=1000",
        "checkpoint.every_steps=10", "trainer.log_every=10")
ATOL = 1e-6  # 2 workers vs 1 with accumulation: the same sums, added in another order (float32)


# ---- sampler: every example once an epoch, the same global batches for any split of W x accumulate -------
@pytest.mark.parametrize("n", [64, 101, 513, 640, 2000])
def test_dist_sampler_sees_every_example_once(n):
    rng = np.random.default_rng(n)
    src, tgt = rng.integers(3, 40, n), rng.integers(3, 40, n)
    for world in (1, 2, 3, 4):
        for epoch in (0, 1):
            per_rank = [TokenBatchSampler(src, tgt, 200, seed=7, rank=r, world_size=world).rank_batches(epoch)
                        for r in range(world)]
            assert len({len(b) for b in per_rank}) == 1  # same batch count on every rank: nobody waits
            seen = Counter(int(i) for batches in per_rank for b in batches for i in b)
            assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, (world, epoch)
            for batches in per_rank:
                for b in batches:
                    assert len(b) * max(src[b].max(), tgt[b].max()) <= 200


@pytest.mark.parametrize("n", [411, 448, 1040])
def test_dist_sampler_same_global_batches_as_accumulation(n):
    """Rank r takes global batches r, r+W, ...: step s of W workers consumes global batches sW..sW+W-1,
    as one worker with accumulate=W does, whenever no batch had to be split to share them out evenly."""
    rng = np.random.default_rng(n)
    src, tgt = rng.integers(3, 30, n), rng.integers(3, 30, n)
    one = TokenBatchSampler(src, tgt, 300, seed=3).epoch_batches(1)
    worlds = [w for w in (2, 4) if len(one) % w == 0]
    assert worlds, f"{len(one)} batches: pick sizes that need no split"
    for world in worlds:
        ranks = [TokenBatchSampler(src, tgt, 300, seed=3, rank=r, world_size=world).rank_batches(1)
                 for r in range(world)]
        for step in range(len(one) // world):
            for r in range(world):
                assert np.array_equal(ranks[r][step], one[step * world + r])


def test_dist_loaders_cover_the_training_set():
    """Through the data module (collate and padding included): the ranks' batches of an epoch hold every
    training sequence exactly once."""
    cfg = compose_cfg(*TINY)
    data1 = CopyData(cfg, cfg.seed, 0, 1)
    expected = Counter(tuple(data1.train.src[i].tolist()) for i in range(len(data1.train.src_sizes)))
    for epoch in (0, 1):
        seen = Counter()
        for rank in range(2):
            for batch in CopyData(cfg, cfg.seed, rank, 2).train_loader(epoch):
                for row in batch.src.tolist():
                    seen[tuple(t for t in row if t > 3)] += 1  # drop padding and specials
        assert seen == expected


# ---- end to end: 2 workers == 1 worker x accumulate 2; only rank 0 writes, one run directory -----------
def only_run_dir(cwd: Path, pattern: str) -> Path:
    """The one run directory under cwd/outputs (default hydra.run.dir); nothing else anywhere in cwd."""
    top = sorted(p.name for p in cwd.iterdir())
    assert top == ["outputs"], f"files outside the run directory: {top}"
    runs = [p for p in (cwd / "outputs").glob(pattern) if (p / "checkpoints").is_dir()]
    assert len(runs) == 1, files_under(cwd)
    everything = {p for p in (cwd / "outputs").rglob("*") if p.is_file()}
    assert all(runs[0] in p.parents for p in everything), files_under(cwd)
    return runs[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_two_workers_equal_one_worker_accumulating(tmp_path):
    # 3 steps an epoch; a short warmup so the weights move far more than ATOL in 5 steps
    steps = ("trainer.max_steps=5", "trainer.val_every=100", "checkpoint.every_steps=100", "optim.warmup=10")
    for name in ("acc", "spawn", "torchrun"):
        (tmp_path / name).mkdir()
    train(tmp_path / "acc" / "run", *steps, "trainer.accumulate=2", cwd=tmp_path / "acc")
    # Default run directories, started from empty folders: everything any rank writes must land in one.
    run_cli(train_cmd(*TINY, *steps, *SPAWN2), tmp_path / "spawn")
    torchrun(None, *steps, *CPU, cwd=tmp_path / "torchrun", rdzv_id="equal")
    spawn_dir = only_run_dir(tmp_path / "spawn", "*/*")
    torchrun_dir = only_run_dir(tmp_path / "torchrun", "torchrun-equal")
    for run in (spawn_dir, torchrun_dir):
        assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.log").is_file()
        assert sorted(p.name for p in run.iterdir()) == [".hydra", "checkpoints", "metrics.jsonl", "run.lock",
                                                         "tensorboard", "train.log"]

    acc, spawned, launched = (last_ckpt(tmp_path / "acc" / "run"), last_ckpt(spawn_dir), last_ckpt(torchrun_dir))
    for ck in (acc, spawned, launched):
        assert (ck["trainer"]["step"], ck["trainer"]["epoch"]) == (5, 1)
    assert (spawned["trainer"]["world_size"], acc["trainer"]["world_size"]) == (2, 1)
    assert_same_state(spawned, launched)  # the two launch paths run the same code: bit-identical
    assert_same_weights(spawned, acc, atol=ATOL)
    # ... while training moved them by far more than that, so the comparison means something.
    cfg = compose_cfg(*TINY)
    torch.manual_seed(cfg.seed)  # as transformer.train.worker seeds the initial weights
    init = Transformer.from_config(cfg.model, 11, 11, True).state_dict()
    assert max((acc["model"][k] - v).abs().max().item() for k, v in init.items()) > 1000 * ATOL


# ---- a shared reference: the uninterrupted 2-worker run ------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reference")
    train(root / "run", *LONG, *SPAWN2, cwd=root)
    ck = last_ckpt(root / "run")
    assert ck["trainer"]["step"] == 80
    return ck


def stop_after_first_checkpoint(proc: subprocess.Popen, run: Path, kill) -> int:
    """Waits for the first checkpoint, then calls kill(); returns the step the run had then reached."""
    first = wait_for(lambda: step_files(run), 180, "the first checkpoint", proc)
    kill()
    return int(first[0].stem.split("_")[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_sigterm_to_spawn_parent_checkpoints_and_resumes(tmp_path, reference):
    run = tmp_path / "run"
    proc = popen(train_cmd(*TINY, f"hydra.run.dir={run}", *LONG, *SPAWN2), tmp_path)
    stop_after_first_checkpoint(proc, run, lambda: os.kill(proc.pid, signal.SIGTERM))
    err = finish(proc)
    assert proc.returncode == 3, err[-4000:]
    stopped = last_ckpt(run)["trainer"]["step"]
    assert 10 <= stopped < 80 and f"stopped by a signal at step {stopped}" in err
    res = train(run, *LONG, *SPAWN2, cwd=tmp_path)
    assert f"at step {stopped}" in res.stderr
    assert_same_state(last_ckpt(run), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_sigterm_to_torchrun_agent_checkpoints_and_resumes(tmp_path, reference):
    run = tmp_path / "run"
    proc = popen(torchrun_cmd(*TINY, f"hydra.run.dir={run}", *LONG, *CPU, rdzv_id="sigterm"), tmp_path)
    stop_after_first_checkpoint(proc, run, lambda: os.kill(proc.pid, signal.SIGTERM))
    err = finish(proc)
    stopped = last_ckpt(run)["trainer"]["step"]
    assert 10 <= stopped < 80 and f"stopped by a signal at step {stopped}" in err, err[-4000:]
    assert proc.returncode != 0  # torchrun itself reports the signal; the workers exited with code 3
    res = torchrun(run, *LONG, *CPU, cwd=tmp_path, rdzv_id="sigterm")
    assert f"at step {stopped}" in res.stderr
    assert_same_state(last_ckpt(run), reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("share", ["0", "1"], ids=["shared_agent_store", "fresh_store_per_attempt"])
def test_dist_torchrun_restarts_after_sigkill_and_matches(tmp_path, reference, share):
    """A worker SIGKILLed mid-run: torchrun --max-restarts=1 restarts both; they resume from the last
    checkpoint in the same (default, rendezvous-id named) run directory and end bit-identical. Both
    with torchrun's default store shared across attempts (stale keys: pytorch/pytorch#135712, handled
    in transformer.dist) and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what launch/*.sh set)."""
    env = env_for(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=share)
    proc = popen(torchrun_cmd(*TINY, *LONG, *CPU, rdzv_id="restart", max_restarts=1), tmp_path, env=env)
    run = tmp_path / "outputs" / "torchrun-restart"
    killed = {}

    def kill_rank1():
        workers = wait_for(lambda: torchrun_workers(proc.pid), 30, "torchrun's workers", proc)
        killed["pid"] = workers[1]
        os.kill(workers[1], signal.SIGKILL)

    stop_after_first_checkpoint(proc, run, kill_rank1)
    err = finish(proc)
    assert proc.returncode == 0, err[-4000:]
    assert "resumed from" in err and "at step" in err  # the second attempt resumed ...
    only_run_dir(tmp_path, "torchrun-restart")  # ... in the same directory
    assert_same_state(last_ckpt(run), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_spawn_worker_killed_fails_fast_then_resumes(tmp_path, reference):
    run = tmp_path / "run"
    proc = popen(train_cmd(*TINY, f"hydra.run.dir={run}", *LONG, *SPAWN2), tmp_path)

    def kill_one():
        workers = wait_for(lambda: len(spawned_workers(proc.pid)) == 2 and spawned_workers(proc.pid), 30,
                           "the spawned workers", proc)
        os.kill(workers[1], signal.SIGKILL)

    stop_after_first_checkpoint(proc, run, kill_one)
    start = time.time()
    err = finish(proc, timeout=120)  # no hang: the survivor is stopped, the parent returns
    assert proc.returncode == 1, err[-4000:]
    assert "died (killed by SIGKILL)" in err and f"hydra.run.dir={run}" in err, err[-4000:]
    assert time.time() - start < 60
    res = train(run, *LONG, *SPAWN2, cwd=tmp_path)
    assert "resumed from" in res.stderr
    assert_same_state(last_ckpt(run), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_two_torchrun_agents_form_one_job(tmp_path):
    """--nnodes=2 --nproc-per-node=2 on localhost: 4 ranks, global rank 0 on one node writes one run dir."""
    endpoint = f"127.0.0.1:{free_port()}"
    steps = ("trainer.max_steps=4", "trainer.val_every=100", "checkpoint.every_steps=2", *CPU)
    cmds = [torchrun_cmd(*TINY, *steps, nnodes=2, rdzv_id="nodes", endpoint=endpoint) for _ in range(2)]
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
    # The first agent hosts the c10d store on the endpoint; both run in their own folder, as on two machines.
    agents = [popen(cmds[0], tmp_path / "node0"), popen(cmds[1], tmp_path / "node1")]
    errs = [finish(a) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(e[-3000:] for e in errs)
    writers = [n for n in ("node0", "node1") if any((tmp_path / n).iterdir())]
    assert len(writers) == 1, files_under(tmp_path)
    run = only_run_dir(tmp_path / writers[0], "torchrun-nodes")
    ck = last_ckpt(run)
    assert ck["trainer"]["world_size"] == 4 and len(ck["rng"]) == 4 and ck["trainer"]["step"] == 4
    assert "4 worker(s)" in (run / "train.log").read_text()


@pytest.mark.slow
def test_dist_jobs_started_together_get_their_own_run_dirs(tmp_path):
    """Default hydra.run.dir: two jobs started in the same second never share a directory."""
    cmd = train_cmd(*TINY, "trainer.max_steps=1", "trainer.val_every=100")
    procs = [popen(cmd, tmp_path) for _ in range(2)]
    errs = [finish(p) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    runs = sorted(p.parent for p in (tmp_path / "outputs").glob("*/*/checkpoints"))
    assert len(runs) == 2, files_under(tmp_path)
    for run in runs:
        assert last_ckpt(run)["trainer"]["step"] == 1


def test_dist_run_name_differs_within_one_second(monkeypatch):
    """The default run directory name: a random suffix tells apart two jobs of the same second; under
    torchrun it is the rendezvous id, so every restart attempt (and every node) agrees on it."""
    from transformer.cli import train as train_module

    monkeypatch.setattr(train_module.time, "strftime", lambda fmt: "2024-01-01/00-00-00-")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    names = set()
    for _ in range(2):
        monkeypatch.setattr(train_module, "_RUN_NAME", None)
        names.add(train_module.run_name())
    assert len(names) == 2 and all(n.startswith("2024-01-01/00-00-00-") for n in names)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setattr(train_module, "_RUN_NAME", None)
    assert train_module.run_name() == "torchrun-job42"


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _threads_after_worker(rank: int, port: int, cfg: dict, out: str) -> None:
    from transformer.training.launcher import worker

    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0)
    Path(f"{out}/run").mkdir(exist_ok=True)  # Hydra makes it for the CLI
    code = worker(rank, rank, 2, cfg, f"{out}/run" if rank == 0 else None, store)
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    Path(f"{out}/rank{rank}.txt").write_text(f"{code} {' '.join(sorted(names))}")


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names come from Linux's /proc")
def test_dist_worker_joins_the_gloo_threads_before_it_returns(tmp_path):
    """After a 2-worker run (DDP, collectives, final test) the process group is really destroyed, its gloo
    threads joined, before the worker returns: left running into interpreter finalization, one of them
    aborted about 1 two-worker run in 30 with SIGABRT."""
    from transformer.config import to_container

    cfg = to_container(compose_cfg(*TINY, "trainer.max_steps=2", "trainer.val_every=1", *CPU))
    torch.multiprocessing.spawn(_threads_after_worker, args=(free_port(), cfg, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        code, *names = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert code == "0"
        assert not set(names) & set(GLOO_THREADS), f"rank {rank} still runs {names}"


@pytest.mark.slow
@pytest.mark.distributed
def test_dist_multirun_sweep_gives_each_job_one_run_dir(tmp_path):
    """`transformer-train -m` with 2 spawned workers per job: one run directory per sweep job, each written
    by that job's rank 0 alone, and nothing written anywhere else."""
    cmd = train_cmd("-m", *TINY, *SPAWN2, "trainer.max_steps=2", "trainer.val_every=100", "seed=1,2",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}")
    res = run_cli(cmd, tmp_path)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"], files_under(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"], files_under(tmp_path)
    weights = []
    for job, seed in zip(jobs, (1, 2), strict=False):
        run = tmp_path / "sweep" / job
        ck = last_ckpt(run)
        assert ck["trainer"]["step"] == 2 and ck["trainer"]["world_size"] == 2 and ck["config"]["seed"] == seed
        assert (run / ".hydra" / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
        assert "2 worker(s)" in (run / "train.log").read_text()
        weights.append(ck["model"])
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "seeds 1 and 2 trained alike"
    assert "Traceback" not in res.stderr
