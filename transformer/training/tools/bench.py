"""The core of `transformer-bench`: warm-up, then timed optimiser steps of the training config, through
the trainer's own step (`Trainer._train_step`), on real data or `bench.synthetic=true` batches, collated by
the same DataLoader workers as training (data.num_workers).

Reported: real (non-pad) target and source tokens/s, sentences/s, where a step's time goes (data wait on
the host; forward+backward, the statistics all-reduce and the optimiser from CUDA events or the CPU
clock), peak memory, model FLOPs per step (transformer/model/flops.py) and MFU = achieved / peak: a GPU's
datasheet peak, a CPU's measured `torch.mm` peak at the model's shapes (transformer/training/tools/peak.py), or
`bench.peak_tflops`. Useful FLOPs are those of the real tokens, each sentence at
its own length: what padding adds (to the batch's longest sentence, and to trainer.pad_to_multiple) is
reported apart as waste, never as useful work. The timed steps run as `bench.repeats` windows whose spread
is reported; then a profile window gives the device busy fraction, the top kernels (top operators on a
CPU) and the whole kernel account: kernels, device time by kernel family and host launch calls per step
(transformer/training/tools/profiling.py); the report's table: transformer/training/tools/bench_report.py. Under
torchrun every rank runs steps; tokens/s are for the whole job and MFU per GPU.
"""
import itertools
import logging
import os
import resource
import subprocess
import time
from pathlib import Path
from statistics import median
from typing import List, Optional

import torch

from transformer import dist
from transformer.config import ConfigError
from transformer.config_checks import validate
from transformer.data.batch import PAD
from transformer.experimental import packed, regional_compile
from transformer.model.flops import real_flops, step_flops
from transformer.training.loop.hotpath import NO_MARKS, LaggedFlag, StepTimer, TrainWindow
from transformer.training.reporting.logs import Progress, setup_logging
from transformer.training.speed import speedups
from transformer.training.tools.peak import cpu_peak_tflops, peak_tflops
from transformer.training.tools.profiling import profile_window

log = logging.getLogger(__name__)

def check_bench(cfg) -> None:
    b = cfg.bench
    for key, ok, why in (("warmup", b.warmup >= 0, "must be >= 0"),
                         ("steps", b.steps is None or b.steps >= 1, "must be >= 1"),
                         ("repeats", b.repeats >= 1, "must be >= 1"),
                         ("profile_steps", b.profile_steps >= 1, "must be >= 1"), ("top", b.top >= 1, "must be >= 1"),
                         ("sentences", b.sentences >= 1, "must be >= 1"),
                         ("vocab_size", b.vocab_size > 4, "must exceed the 4 special tokens"),
                         ("min_len", b.min_len >= 1, "must be >= 1"),
                         ("max_len", b.max_len >= b.min_len, "must be >= bench.min_len"),
                         ("length_std", b.length_std >= 0, "must be >= 0"),
                         ("peak_tflops", b.peak_tflops is None or b.peak_tflops > 0, "must be > 0 or null"),
                         ("trace", b.trace is None or b.profile, "needs bench.profile=true (it is that window's)")):
        if not ok:
            raise ConfigError(f"bench.{key}={b[key]!r}: {why}")


@dist.rank_zero
def check_outputs(b) -> None:
    """The folders of bench.out and bench.trace, made and found writable before minutes of measuring, not after."""
    for key in ("out", "trace"):
        if b[key]:
            folder = Path(b[key]).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"bench.{key}={b[key]!r}: cannot make its folder ({e.strerror})") from None
            if not os.access(folder, os.W_OK):
                raise ConfigError(f"bench.{key}={b[key]!r}: its folder {folder} is not writable")


def build(cfg, env):
    """The data (real or synthetic) and a Trainer with no run directory: a benchmark writes no files."""
    from transformer.experimental.microbatch import fit_micro_batch
    from transformer.tasks import build_task
    from transformer.training.distributed.parallelize import build_model, parallelize
    from transformer.training.loop.trainer import Trainer

    if cfg.bench.synthetic:
        from transformer.data.module import loader_workers
        from transformer.data.synthetic import SyntheticData
        data = SyntheticData(cfg, env.rank, env.world_size, pin_memory=env.device.type == "cuda",
                             num_workers=loader_workers(cfg.data.num_workers, env.device))
    else:
        from transformer.data import build_data
        cfg.data.max_tokens_by_epoch = []  # a ramp is a training schedule: the benchmark times max_tokens batches
        data = build_data(cfg, env, None)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data)
    torch.manual_seed(cfg.seed + env.rank)
    trainer = Trainer(cfg, env, parallelize(model, cfg, env), data, build_task(cfg), None)
    fit_micro_batch(trainer)  # trainer.micro_batch=fit: the split a training run would choose
    return trainer


def endless_batches(data):
    for epoch in itertools.count():
        yield from data.train_loader(epoch)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Totals:
    """What the timed steps processed, counted on the host from the CPU batches (no device reads): real tokens,
    and the FLOPs of the real tokens (each sentence at its own lengths), of the batches' own padded shapes, and
    of the shapes the model runs on (lengths padded up to `multiple`, or, with trainer.static_shapes, the
    static shape `shape_of(batch)` returns: its extra rows and lengths count as waste too).

    `add` runs inside the timed steps, so it only keeps each batch's lengths and shapes; `tally()`, after the
    window's clock has stopped, does the counting (Python and numpy work that a training step does not do and
    that would otherwise be timed as the host's)."""

    def __init__(self, args, multiple: int, shape_of=None):
        self.args, self.multiple, self.shape_of = args, multiple, shape_of
        self.shapes = set()  # the distinct shapes the model ran on
        self.tgt = self.src = self.sentences = self.slots = 0
        self.flops_real = self.flops_batch = self.flops_run = 0
        self.data_s = 0.0
        self._kept: List[tuple] = []  # per batch: (src lengths, tgt lengths, (B, S, T), run shape, target tokens)

    def add(self, micro, data_s: float) -> None:
        self.data_s += data_s
        for b in micro:
            if b.src.dim() == 1:  # packed token budgets: run at its sentences' own lengths, filler included
                src_lens, tgt_lens = packed.real_lengths(b)
                run = tuple(p.lengths.numpy() for p in b.packings)
                self._kept.append((src_lens, tgt_lens, None, packed.shape_of(b), b.n_tokens, run))
                continue
            B, S = b.src.shape
            T = b.tgt_in.size(1)
            shape = self.shape_of(b) if self.shape_of is not None else None
            self._kept.append(((b.src != PAD).sum(1), (b.tgt_out != PAD).sum(1), (B, S, T), shape, b.n_tokens, None))

    def tally(self) -> "Totals":
        """Counts what `add` kept; returns self. A packed batch has no padding of its own (its batch FLOPs are
        its real ones); its filler sentences are the waste of its static shape."""
        m = self.multiple
        for src_lens, tgt_lens, padded, shape, n_tokens, run in self._kept:
            src_lens, tgt_lens = src_lens.tolist(), tgt_lens.tolist()  # CPU tensors or arrays
            real = real_flops(self.args, src_lens, tgt_lens)
            self.flops_real += real
            if run is not None:  # packed: no target padding
                B, slots = len(src_lens), sum(tgt_lens)
                self.flops_batch += real
                self.flops_run += real_flops(self.args, run[0].tolist(), run[1].tolist())
            else:
                B, S, T = padded
                slots = B * T
                self.flops_batch += step_flops(self.args, [(B, S, T)])
                shape = shape if shape is not None else (B, -(-S // m) * m, -(-T // m) * m)
                self.flops_run += step_flops(self.args, [shape])
            self.shapes.add(shape)
            self.tgt += n_tokens
            self.src += sum(src_lens)
            self.sentences += B
            self.slots += slots
        self._kept.clear()
        return self


def run_steps(trainer, batches, n: int, progress: Progress, totals: Optional[Totals] = None,
              flag: Optional[LaggedFlag] = None) -> None:
    K = trainer.accumulate
    window, flag = TrainWindow(), flag if flag is not None else LaggedFlag()
    for _ in range(n):
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(K)]
        if totals is not None:
            totals.add(micro, time.perf_counter() - t0)
        trainer._train_step(micro, window, flag)
        progress.update()


def cpu_probe(trainer) -> float:
    """The CPU's `torch.mm` peak at the model's shapes, TFLOP/s (transformer/training/tools/peak.py). `measure`
    probes just before and just after the timed windows and the higher counts: on a shared host one probe can meet
    a busy neighbour and read far low (docs/benchmarks/2026-12-03-cpu-step.md)."""
    compute = speedups.compute_type(trainer.amp_dtype, trainer.env.device)
    return cpu_peak_tflops(trainer.model.args, trainer.data.train_sampler.max_tokens, compute)


def timed_steps(b, device: torch.device) -> int:
    """bench.steps, or its default: 100 on a GPU (a step there is milliseconds), 20 on a CPU."""
    if b.steps is not None:
        return b.steps
    return 100 if device.type == "cuda" else 20


def measure(trainer, b) -> dict:
    """Warm-up steps, then `b.repeats` windows of timed steps, then (bench.profile) a profile window; returns
    the numbers of this rank. The windows share one batch stream, as one run's consecutive steps would."""
    device = trainer.env.device
    steps = timed_steps(b, device)
    batches = endless_batches(trainer.data)
    progress = Progress(b.warmup + steps * b.repeats, 0, trainer.tcfg.progress)
    t0 = time.perf_counter()
    run_steps(trainer, batches, b.warmup, progress)
    settled = settle(trainer, batches, limit=max(200, 4 * b.warmup))
    _sync(device)
    warmup_s = time.perf_counter() - t0
    graphs_warm = speedups.compiled_graphs()
    captured_warm = captured(trainer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probes = [cpu_probe(trainer)] if device.type == "cpu" and not b.peak_tflops else []
    trainer.stepper.marks = timer = StepTimer(device)  # the step's phase marks, timed
    windows = []  # (wall seconds, Totals) of each repeat
    flag = LaggedFlag()  # the trainer's: its waits are the host syncs of the stop flag
    for _ in range(b.repeats):
        totals = Totals(trainer.model.args, trainer.pad_multiple, shape_of(trainer))
        t0 = time.perf_counter()
        run_steps(trainer, batches, steps, progress, totals, flag)
        _sync(device)
        windows.append((time.perf_counter() - t0, totals.tally()))
    trainer.stepper.marks = NO_MARKS
    progress.close()
    if probes:
        probes.append(cpu_probe(trainer))
    phases, host_phases = timer.summary(), timer.host_summary()
    graphs = speedups.compiled_graphs()
    prof = None
    if b.profile:
        prof = profile_window(lambda n: run_steps(trainer, batches, n, Progress(None, 0, False)),
                              lambda: _sync(device), device, b.profile_steps, b.top, b.trace)
    return {"steps": steps, "windows": windows, "flag_waits": flag.waits, "warmup_s": warmup_s,
            "warmup_steps": b.warmup + settled, "phases": phases, "host_phases": host_phases,
            "profile": prof,
            "graphs": graphs if trainer.tcfg.compile else None,
            "graphs_during_timed": (graphs - graphs_warm) if trainer.tcfg.compile and graphs is not None else None,
            "compile_cache": regional_compile.compile_cache_hits() if trainer.tcfg.compile else None,
            "cuda_graphs_captured": captured(trainer),
            "cuda_graphs_captured_timed": captured(trainer) - captured_warm if trainer.graphs is not None else None,
            "peak_probes": probes,
            "peak_mem_gb": peak_memory_gb(device),
            # what the caching allocator holds, CUDA graphs' private pools included: the peak above resets after
            # the warm-up, so it leaves out the memory of graphs captured there
            "reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None}


def settle(trainer, batches, limit: int, quiet: int = 20) -> int:
    """With CUDA graphs or torch.compile, warm-up steps past bench.warmup until `quiet` steps in a row capture
    and compile nothing (at most `limit`): a capture or a compilation costs many steps' time, and one in the
    timed steps would count as step time. Returns the steps it added (0 without either, and with several
    workers, whose batches and so captures differ: their step counts must stay equal)."""
    if (trainer.graphs is None and not trainer.tcfg.compile) or trainer.env.world_size > 1:
        return 0
    added, calm, last = 0, 0, (captured(trainer), speedups.compiled_graphs())
    quiet_progress = Progress(None, 0, False)
    while calm < quiet and added < limit:
        run_steps(trainer, batches, 1, quiet_progress)
        added += 1
        now = (captured(trainer), speedups.compiled_graphs())
        calm, last = (calm + 1 if now == last else 0), now
    return added


def captured(trainer):
    """Micro-batch CUDA graphs captured so far (trainer.cuda_graphs on a GPU), or None."""
    return len(trainer.graphs.micro) if trainer.graphs is not None else None


def shape_of(trainer):
    """The static shape a batch is padded to (trainer.static_shapes, trainer.cuda_graphs), or None."""
    return trainer._static_shape if trainer.static_shapes else None


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


def _spread(values) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values)}


def summarise(trainer, cfg, m: dict) -> dict:
    """One JSON-able record: this job's throughput and, per worker, time split, memory, FLOPs, waste and MFU."""
    env, b, steps = trainer.env, cfg.bench, m["steps"]
    windows = m["windows"]
    n = len(windows)
    t = Totals(trainer.model.args, trainer.pad_multiple)  # all windows together
    t.shapes = set().union(*(w.shapes for _, w in windows))
    for key in ("tgt", "src", "sentences", "slots", "flops_real", "flops_batch", "flops_run", "data_s"):
        setattr(t, key, sum(getattr(w, key) for _, w in windows))
    local_wall = sum(wall for wall, _ in windows)
    tgt, src, sents, slots, *tgt_by_window = env.all_reduce_sum(
        [t.tgt, t.src, t.sentences, t.slots, *(w.tgt for _, w in windows)])
    walls = env.all_reduce_max([wall for wall, _ in windows])
    wall = sum(walls)
    total_steps = steps * n
    flops = t.flops_real / total_steps  # this worker's useful FLOPs per optimiser step: real tokens only
    flops_run = t.flops_run / total_steps  # what its model computed, padding included
    achieved, achieved_run = t.flops_real / local_wall, t.flops_run / local_wall
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    compute = speedups.compute_type(trainer.amp_dtype, trainer.env.device)
    peak, peak_source = b.peak_tflops, "bench.peak_tflops"
    if not peak and env.device.type == "cuda":
        peak, peak_source = peak_tflops(name, compute), "datasheet"
    elif not peak and env.device.type == "cpu":  # no datasheet: torch.mm at the model's shapes, around the windows
        peak, peak_source = max(m["peak_probes"]), f"torch.mm {compute} at the model's shapes"
    step_ms = 1e3 * local_wall / total_steps
    split = {"data_wait_ms": 1e3 * t.data_s / total_steps,
             **{f"{k}_ms": v for k, v in m["phases"].items()}}
    if not env.distributed:
        split["communication_ms"] = None  # one worker: nothing to communicate
    split["other_ms"] = max(step_ms - sum(v for v in split.values() if v is not None), 0.0)
    a = trainer.model.args
    per_window = [tok / w for tok, w in zip(tgt_by_window, walls, strict=True)]
    mfu_window = [w_t.flops_real / w / (peak * 1e12) for w, (_, w_t) in zip(walls, windows, strict=True)] if peak \
        else None
    prof = m["profile"]
    return {
        "device": name, "workers": env.world_size, "torch": torch.__version__, "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": torch.get_num_threads(),
        "model": {k: getattr(a, k) for k in ("N", "N_dec", "d_model", "d_ff", "h", "src_vocab_size",
                                             "tgt_vocab_size")},
        "params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 2),
        "data": "synthetic" if b.synthetic else cfg.data.name, "max_tokens": trainer.data.train_sampler.max_tokens,
        "loader_workers": trainer.data.num_workers, "loss": trainer.parallel.loss,
        "accumulate": trainer.accumulate, "compute": compute, "compile": trainer.tcfg.compile,
        "compile_scope": trainer.tcfg.compile_scope if trainer.tcfg.compile else None,
        "pad_to_multiple": trainer.pad_multiple, "static_shapes": trainer.static_shapes,
        "cuda_graphs": trainer.tcfg.cuda_graphs, "shapes": len(t.shapes),
        "activation_checkpointing": trainer.tcfg.activation_checkpointing,
        "warmup_steps": m["warmup_steps"], "warmup_s": m["warmup_s"], "steps": steps, "repeats": n, "wall_s": wall,
        "tgt_tokens_per_s": tgt / wall, "src_tokens_per_s": src / wall, "sentences_per_s": sents / wall,
        "tgt_tokens_per_s_spread": _spread(per_window),
        "target_padding": 1 - tgt / max(slots, 1), "step_ms": step_ms,
        **split,
        # the host's own time queuing each phase (on a CPU, the phases themselves), and with the data wait
        "host_ms": m["host_phases"], "host_step_ms": split["data_wait_ms"] + sum(m["host_phases"].values()),
        "peak_mem_gb": m["peak_mem_gb"], "peak_mem_kind": "cuda_max_allocated" if name != "cpu" else "process_rss",
        "reserved_gb": m["reserved_gb"],
        "flops_per_step": flops, "flops_computed_per_step": flops_run,
        "waste_padding": (t.flops_batch - t.flops_real) / max(t.flops_run, 1),
        "waste_pad_multiple": (t.flops_run - t.flops_batch) / max(t.flops_run, 1),
        "achieved_tflops": achieved / 1e12, "achieved_tflops_computed": achieved_run / 1e12, "peak_tflops": peak,
        "peak_source": peak_source if peak else None, "peak_probes": m["peak_probes"] or None,
        "mfu": achieved / (peak * 1e12) if peak else None,
        "mfu_computed": achieved_run / (peak * 1e12) if peak else None,
        "mfu_spread": _spread(mfu_window) if mfu_window else None,
        "flag_waits_per_step": m["flag_waits"] / total_steps,
        "host_syncs_per_step": prof["host_syncs"] / prof["steps"] if prof and prof["host_syncs"] is not None
        else None,
        "busy": prof["busy"] if prof else None, "profile_steps": prof["steps"] if prof else None,
        "trace": b.trace if prof else None,
        "kernel_account": prof["account"] if prof else None,
        "top_ops": prof["top"] if prof else None, "top_ops_kind": (
            ("kernels_self_device" if env.device.type == "cuda" else "ops_self_cpu") if prof else None),
        "graphs": m["graphs"], "graphs_during_timed": m["graphs_during_timed"], "compile_cache": m["compile_cache"],
        **{k: m[k] for k in ("cuda_graphs_captured", "cuda_graphs_captured_timed")},
    }


def _commit() -> Optional[str]:
    if os.environ.get("BENCH_COMMIT"):  # set by benchmarks/bench_gpu.py: a copied tree may have no .git
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_benchmark(cfg) -> Optional[dict]:
    """Composes nothing: `cfg` is the training config with its `bench` node. Returns the record (rank 0)."""
    validate(cfg)
    check_bench(cfg)
    run = dist.torchrun_env() or {"rank": 0, "local_rank": 0, "world_size": 1}
    env = dist.init(run["rank"], run["local_rank"], run["world_size"], cfg.trainer.accelerator, cfg.trainer.timeout_s)
    setup_logging(None)
    try:
        check_outputs(cfg.bench)
        record = _measure(cfg, env)  # the trainer is gone when dist.close() runs
        _report(record, cfg.bench.out)
        return record if env.is_main else None
    finally:
        dist.close()


def _measure(cfg, env: dist.DistEnv) -> dict:
    trainer = build(cfg, env)
    record = summarise(trainer, cfg, measure(trainer, cfg.bench))
    trainer.close()
    return record


@dist.rank_zero
def _report(record: dict, out: Optional[str]) -> None:
    import json

    from transformer.training.tools.bench_report import table

    line = json.dumps(record)
    print(table(record))
    print(line, flush=True)
    if out:  # its folder made by check_outputs before the measuring
        with open(out, "a") as f:
            f.write(line + "\n")
