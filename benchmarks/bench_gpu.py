"""`make bench-gpu`: the prepared script for a short GPU lease (one H100/H200, under 8 minutes). It runs
transformer-bench on synthetic batches for each (workload, switch set) of PLAN, most important first, within a
time budget (what does not fit is recorded as skipped): HEAD's runs, then the loss benchmark, then the GPU test
tier (alone with --tests-only: a lease's second call), then the rest; then decoding speed when Multi30k is at
hand. Every record goes, one JSON object a line, to --out; a Markdown summary (device, date, torch, CUDA,
commit; one row per run; the top kernels of the profiled runs) goes beside it (--out with .md) and to stdout.
Uses the interpreter it runs under: a machine's own CUDA torch, with this package importable from the
repository (no install, no download).

    python benchmarks/bench_gpu.py --out outputs/bench-gpu.jsonl [--skip-tests | --tests-only] [--only big]
        [--sets all+unpadded,cuda_graphs+unpadded] [--budget-s 450] [--tier-workers 4] [--start-at big@16k:all]
        [--switch name=key=value,key=value ...] [--decode-checkpoint RUN/checkpoints/best.pt]
        [--compile-cache outputs/compile-cache.tar.gz]   # an earlier lease's compile caches; this one's beside --out
    python benchmarks/bench_gpu.py --dry-run --out /tmp/dry.jsonl   # the plumbing on a CPU, everything shrunk

To extend: a new switch set is one line of SWITCH_SETS (and its workloads in PLAN); a set whose keys this
checkout's config lacks is skipped and recorded, so the table may name switches that are still on a branch.
"""
import argparse
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import compile_cache  # noqa: E402  (beside this script)
from gpu_report import markdown  # noqa: E402  (the summary table, beside this script)
from gpu_tier import append, env, run_group, run_tests  # noqa: E402  (beside this script)

# Workloads: synthetic batches (vocabulary 32,000 and lengths ~ N(27, 12) unless set) at the recipes' own
# per-GPU micro-batches (conf/experiment: the WMT14 recipes' data.max_tokens, experiment=multi30k's model and
# batch, its vocabulary and short sentences approximated) and at 16k and 32k tokens.
WORKLOADS = {
    "multi30k": ("experiment=multi30k", "bench.vocab_size=8000", "bench.length_mean=14", "bench.length_std=5"),
    "base@recipe": ("experiment=wmt14_base", "speed=eager"),  # the sets switch on top of eager
    "base@16k": ("model=base", "data.max_tokens=16384"),
    "big@recipe": ("experiment=wmt14_big", "speed=eager"),
    "big@16k": ("model=big", "data.max_tokens=16384"),
    "big@32k": ("model=big", "data.max_tokens=32768"),
}
# Switch sets: name -> overrides. "eager" is the baseline (the defaults: bf16 autocast, trainer.loss=auto).
SWITCH_SETS = {
    "eager": (),
    "cuda_graphs": ("trainer.cuda_graphs=true",),  # static shapes, each step replayed as CUDA graphs
    # a ladder of 8 lengths an octave: half the ladder's padding (Multi30k at 2,048 tokens: 5.8 % against 11.4 %),
    # 2.5 times the shapes to capture (benchmarks/bench_shapes.py --steps 4,8)
    "cuda_graphs+steps8": ("trainer.cuda_graphs=true", "trainer.shape_steps=8"),
    "static_shapes": ("trainer.static_shapes=true",),  # the same shapes eager: what the padding costs
    "compile+bf16_residual": ("trainer.compile=true", "trainer.bf16_residual=true"),  # fused dropout+add+norm
    "bf16_residual": ("trainer.bf16_residual=true",),  # the residual stream in bf16, eager
    # packed real tokens; torch's varlen kernel has no dropout, so none on the attention weights (the paper's
    # Section 5.4 has none there; flash-attn would keep it): the sublayers and embeddings still drop at P_drop
    "unpadded": ("trainer.unpadded_attention=true", "model.attention_dropout=0"),
    "compile+unpadded": ("trainer.compile=true", "trainer.unpadded_attention=true", "model.attention_dropout=0"),
    # packed token budgets (transformer/experimental/packed.py): the real tokens end to end, filled to a few token
    # counts,
    # each step replayed as CUDA graphs: neither padding nor the ladder's rounding, a little filler instead
    "cuda_graphs+unpadded": ("trainer.cuda_graphs=true", "trainer.unpadded_attention=true",
                             "model.attention_dropout=0"),
    # model=base and big before they took Section 5.4's placement (docs/benchmarks/switches.md, "Dropout of the paper's
    # models"): P_drop on the attention weights and inside the feed-forward network too; against eager, what it buys
    "dropout_everywhere": ("model.attention_dropout=null", "model.ffn_dropout=null"),
    "compile": ("trainer.compile=true",),
    # the fastest step measured with compile's lengths rounded up to a multiple of 8, its default until 2026-11-29
    # (waste_pad_multiple 11 %): whether any kernel gains from the rounding, which the default no longer does
    "compile+bf16_residual+pad8": ("trainer.compile=true", "trainer.bf16_residual=true", "trainer.pad_to_multiple=8"),
    "loss=reference": ("trainer.loss=reference",),  # the log_softmax loss the fused one replaces
    "loss=fused": ("trainer.loss=fused",),  # the hand-written chunked loss (trainer.loss=auto takes compiled on GPUs)
    "fp8": ("trainer.precision=fp8",),  # float8 Linear products (torchao; sm_89+), bf16 elsewhere
    "compile+fp8": ("trainer.compile=true", "trainer.precision=fp8"),  # torchao's casts fused by the compiler
    # every switch that removes work or launches at once (compile + CUDA graphs: never run together yet)
    "all": ("trainer.compile=true", "trainer.bf16_residual=true", "trainer.cuda_graphs=true",
            "trainer.loss=compiled"),
    "all+unpadded": ("trainer.compile=true", "trainer.bf16_residual=true", "trainer.cuda_graphs=true",
                     "trainer.loss=compiled", "trainer.unpadded_attention=true", "model.attention_dropout=0"),
}
# `env.NAME=VALUE` entries set a variable of the run's environment, not a config key. Inductor's mix-order
# reduction makes the LayerNorm backward one kernel with its weight-gradient sums, which ran some 3x slower than
# its bytes take (docs/benchmarks/2026-11-gpu.md, "GPU: H200, 2026-11-29"): `all+unpadded` without it says whether the
# split kernels are faster.
SWITCH_SETS["all+unpadded+no_mix_order"] = (*SWITCH_SETS["all+unpadded"], "env.TORCHINDUCTOR_MIX_ORDER_REDUCTION=0")
# torch.compile per layer (trainer.compile_scope=layers): two graphs to compile instead of the whole model (its
# compile time on CPUs: docs/benchmarks/switches.md); whether its step is as fast as the whole model's, which may fuse
# across layers, is what the GPU says.
SWITCH_SETS["all+unpadded+layers"] = (*SWITCH_SETS["all+unpadded"], "trainer.compile_scope=layers")
# CUDA graphs capture each new static shape (a few steps' time): more warm-up keeps captures out of the timing.
SWITCH_SETS = {k: (*v, "bench.warmup=60") if "trainer.cuda_graphs=true" in v else v for k, v in SWITCH_SETS.items()}
# trainer.micro_batch=fit: the WMT14 recipes' 8-GPU update on one GPU (1 x 8 x 3,300 tokens), as 8 micro-batches
# (fixed) and as the largest micro-batch the GPU holds (fit); fewer steps: a step of 8 micro-batches is long.
FIT_SETS = {"acc8": ("trainer.accumulate=8", "trainer.micro_batch=fixed"),
            "acc8+fit": ("trainer.accumulate=8", "trainer.micro_batch=fit")}
FIT_SETS = {k: (*v, "bench.steps=30", "bench.repeats=2", "bench.warmup=5") for k, v in FIT_SETS.items()}
SWITCH_SETS.update(FIT_SETS)
# What runs, most telling first (past --budget-s the rest is skipped). HEAD, before the GPU test tier: big and
# base at 16k with the defaults, the baseline each lease measures again (under a minute each). Then base with the
# dropout the paper's models had before (what Section 5.4's placement buys, eager), and the candidates for
# issue 48's targets: every switch on packed token budgets (no padding, torch's varlen kernel),
# those budgets graphed alone (since 2026-11-29) and on Multi30k's batches; compile on packed tokens; packed
# tokens without inductor's mix-order reduction; `all` (every switch on the padded ladder, measured once; over
# two minutes a run, mostly compiling); then the questions of defaults: the
# fastest step measured before, without and with the rounding to 8; fp8 and compile alone, never measured; the
# recipe's update on one GPU fixed and fitted; Multi30k's other sets; the sets measured before, again; the
# remaining workloads eager; then every switch set at the recipes' sizes. A call of 430 s holds HEAD and two or
# three compiled runs, or more uncompiled ones (docs/benchmarks/measuring.md).
HEAD = [(w, "eager") for w in ("big@16k", "base@16k")]
PACKED = ("all+unpadded", "cuda_graphs+unpadded")
FIRST = ("compile+unpadded", "all+unpadded+no_mix_order", "all", "compile+bf16_residual",
         "compile+bf16_residual+pad8", "fp8", "compile+fp8", "compile", "loss=fused", "cuda_graphs")
# the whole model's compile against the layers' first, for big, whose whole-model warm-up is the longest
PAIR = [("big@16k", "all+unpadded"), ("big@16k", "all+unpadded+layers"), ("base@16k", "all+unpadded+layers")]
# The presets (conf/speed/) as the sets that spell them out, timed right after HEAD: compiled_graphs = `all`,
# graphs = `cuda_graphs`, compiled = `compile+bf16_residual` (docs/performance.md "Presets").
PRESETS = [("big@16k", "all"), ("base@16k", "all"), ("multi30k", "cuda_graphs"), ("multi30k", "all"),
           ("big@16k", "compile+bf16_residual")]
PLAN = (HEAD + PRESETS + [("base@16k", "dropout_everywhere")] + PAIR
        + [(w, s) for s in PACKED for w in ("big@16k", "base@16k")]
        + [("multi30k", s) for s in ("cuda_graphs+unpadded", "cuda_graphs")]
        + [(w, s) for s in FIRST for w in ("big@16k", "base@16k")]
        + [("big@recipe", s) for s in FIT_SETS]
        + [("multi30k", s) for s in ("eager", "cuda_graphs+steps8", "all")]
        + [(w, s) for s in SWITCH_SETS if s != "eager" and s not in FIT_SETS for w in ("big@16k", "base@16k")]
        + [(w, "eager") for w in ("big@recipe", "base@recipe", "big@32k")]
        + [(w, s) for w in ("big@recipe", "base@recipe") for s in SWITCH_SETS if s != "eager"])
PLAN = list(dict.fromkeys(PLAN))  # each run once, at its first place
# 3 timed windows of 40 steps (issue 48: at least 100 steps, and the spread of repeats), after 10 warm-up steps
COMMON = ("bench.synthetic=true", "bench.warmup=10", "bench.steps=40", "trainer.progress=false")
# Runs that keep files beside --out as well as numbers (<out stem>.<workload>-<set>.*, names the device tool
# brings back): the profile window's timeline (bench.trace: every kernel and host call in order, for Perfetto)
# and, under torch.compile, the code it generated (torch's TORCH_LOGS=output_code): the profile names compiled
# kernels after that code's Triton kernels, so a slow one can be read after the lease. Base with every switch on
# packed tokens, compiled per layer and whole, then the step the host holds back in eager mode; in this order
# while the files fit in MAX_FILES.
KEEP = (("base@16k", "all+unpadded+layers"), ("base@16k", "all+unpadded"), ("base@16k", "eager"))
MAX_FILES = 8  # the files of one device-tool call that come back
# --dry-run: the same plan on a CPU, shrunk to seconds a run. A CPU has no CUDA graphs and compiles for
# minutes, so each set runs as what a CPU can of it (DRY_SWAP: a graphed set's static shapes, packed token
# budgets included, eager; the compiled loss's fused twin); a set that shrinks to one already run is skipped.
DRY_SWAP = {"trainer.cuda_graphs=true": "trainer.static_shapes=true", "trainer.compile=true": None,
            "trainer.compile_scope=layers": None,
            "trainer.loss=compiled": "trainer.loss=fused"}
DRY = ("model=tiny", "model.N=1", "bench.sentences=300", "bench.vocab_size=300", "bench.max_len=30",
       "data.max_tokens=400", "bench.warmup=0", "bench.steps=1", "bench.repeats=1", "bench.profile_steps=1",
       "trainer.accelerator=cpu", "trainer.precision=fp32")


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def config_keys() -> set:
    """Every dotted key of this checkout's config schema (transformer/config.py's dataclasses)."""
    import dataclasses
    import typing

    sys.path.insert(0, str(REPO))
    from transformer.config import Config

    keys = set()

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys.add(prefix + f.name)
            kind = hints.get(f.name)
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                walk(kind, prefix + f.name + ".")
    walk(Config, "")
    return keys


ENV = "env."  # a switch of the environment: env.NAME=VALUE


def split_env(overrides) -> tuple:
    """(config overrides, {NAME: VALUE} of the env. switches)."""
    return ([o for o in overrides if not o.startswith(ENV)],
            dict(o[len(ENV):].split("=", 1) for o in overrides if o.startswith(ENV)))


def missing_keys(overrides, keys: set) -> list:
    config, _ = split_env(overrides)
    return [o.split("=", 1)[0] for o in config
            if "=" in o and "." in o.split("=", 1)[0] and o.split("=", 1)[0] not in keys]


def kept_files(out: Path, workload: str, switches: str) -> dict:
    """The files a KEEP run writes beside `out`: {"trace": ..., "code": ...} (code: under torch.compile only)."""
    stem = out.stem + "." + re.sub(r"[^A-Za-z0-9]+", "-", f"{workload}-{switches}").strip("-")
    return {"trace": out.with_name(stem + ".trace.json.gz"), "code": out.with_name(stem + ".inductor.txt")}


def gzipped(path: Optional[Path]) -> Optional[Path]:
    """`path` replaced by `path`.gz (a compiled model's logged code is megabytes of text; the device tool brings
    back files of up to 16 MiB); None when there is no such file."""
    if path is None or not path.is_file():
        return None
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    return packed


def run_bench(workload: str, switches: str, overrides: list, out: Path, log: Path, timeout: float):
    print(f"--- {workload} [{switches}]: transformer-bench {' '.join(overrides)}", flush=True)
    t0 = time.time()
    base = {"kind": "bench", "workload": workload, "switches": switches, "overrides": overrides}
    overrides, switched = split_env(overrides)
    run_env, code = {**env(), **switched}, None
    if any(o.startswith("bench.trace=") for o in overrides) and "trainer.compile=true" in overrides:
        code = kept_files(out, workload, switches)["code"]
        run_env.update(TORCH_LOGS="output_code", TORCH_LOGS_OUT=str(code))
    try:
        res = run_group([sys.executable, "-m", "transformer.cli.bench", *overrides], cwd=REPO, env=run_env,
                        timeout=timeout)
    except subprocess.TimeoutExpired:
        gzipped(code)
        print(f"    timed out after {timeout:.0f} s", flush=True)
        append(out, {**base, "returncode": 124, "error": f"timed out after {timeout:.0f} s"})
        return None
    code = gzipped(code)
    with open(log, "a") as f:
        f.write(f"--- {workload} [{switches}] {' '.join(overrides)}\n{res.stdout}\n{res.stderr[-5000:]}\n")
    if res.returncode != 0:  # out of memory at a large max_tokens, say: recorded, and the others still run
        error = (res.stderr.strip().splitlines() or [""])[-1]
        print(f"    failed ({res.returncode}): {error}", flush=True)
        append(out, {**base, "returncode": res.returncode, "error": error})
        return None
    record = {**json.loads(res.stdout.strip().splitlines()[-1]), **base, "seconds": round(time.time() - t0, 1),
              "compiled_code": code.name if code is not None else None}
    mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
    print(f"    {record['tgt_tokens_per_s']:,.0f} tgt tok/s, MFU {mfu}, {record['seconds']:.0f} s", flush=True)
    append(out, record)
    return record


def run_loss(out: Path, log: Path, dry: bool) -> str:
    """benchmarks/bench_loss.py at big@16k's generator (16,384 rows, 32,000 types, d_model 1,024, bf16): the fused,
    compiled and reference losses, forward and backward. Returns its output."""
    size = ["--rows", "512", "--vocab", "300", "--repeats", "2", "--device", "cpu"] if dry else \
        ["--rows", "16384", "--vocab", "32000", "--d-model", "1024", "--dtype", "bf16", "--repeats", "10"]
    t0 = time.time()
    try:
        res = run_group([sys.executable, str(REPO / "benchmarks" / "bench_loss.py"), *size], cwd=REPO, env=env(),
                        timeout=120)
        code, text = res.returncode, res.stdout if res.returncode == 0 else res.stdout + res.stderr[-2000:]
    except subprocess.TimeoutExpired:
        code, text = 124, "bench_loss.py timed out after 120 s"
    with open(log, "a") as f:
        f.write(f"--- bench_loss.py {' '.join(size)}\n{text}\n")
    print(f"loss ({time.time() - t0:.0f} s):\n{text}", flush=True)
    append(out, {"kind": "loss", "args": size, "returncode": code, "output": text})
    return text


def run_decode(out: Path, checkpoint) -> None:
    # A trained checkpoint decodes until </s> (its tokenizer travels in the file); the random model needs spaCy.
    args = [str(checkpoint), "--stop-at-eos"] if checkpoint else ["--skip-slow"]
    if not checkpoint and importlib.util.find_spec("spacy") is None:
        print("decoding: skipped (spaCy is not importable here; pass --decode-checkpoint RUN/checkpoints/best.pt)")
        append(out, {"kind": "decode", "skipped": "spacy not importable"})
        return
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_decode.py"), *args, "--device", "cuda"],
                         cwd=REPO, env=env(), capture_output=True, text=True)
    print(res.stdout, res.stderr[-2000:], sep="\n", flush=True)
    append(out, {"kind": "decode", "args": args, "returncode": res.returncode, "output": res.stdout})


def switch_sets(args) -> dict:
    """SWITCH_SETS and the call's own --switch sets (name=key=value,key=value): name -> overrides."""
    sets = dict(SWITCH_SETS)
    for spec in args.switch or []:
        name, _, rest = spec.partition("=")
        sets[name] = tuple(x for x in rest.split(",") if x)
    return sets


def kept_runs(args) -> set:
    """The KEEP runs whose files fit within MAX_FILES beside the call's own (records, summary and log; the GPU
    tier's report unless --skip-tests; the compile cache's archive with --compile-cache), in KEEP's order."""
    left = MAX_FILES - 3 - (not getattr(args, "skip_tests", False)) - bool(getattr(args, "compile_cache", None))
    kept = set()
    for workload, name in KEEP:
        files = 1 + ("trainer.compile=true" in SWITCH_SETS[name] and not args.dry_run)  # the trace, the code
        if files <= left:
            kept.add((workload, name))
            left -= files
    return kept


def plan(args, keys: set) -> tuple:
    """[(workload, switch set name, overrides)] to run, and [(workload, switch set, why)] skipped up front."""
    sets = switch_sets(args)
    entries = list(PLAN) + [(w, name) for name in sets if name not in SWITCH_SETS
                            for w in ("big@16k", "base@16k")]
    todo, skipped, dry_seen, kept = [], [], {}, kept_runs(args)
    for workload, name in entries:
        if args.only and not workload.startswith(args.only) or args.sets and name not in args.sets:
            continue
        switch = sets[name]
        lacking = missing_keys(switch, keys)
        if args.dry_run:  # DRY's own warm-up replaces a graphed set's
            switch = tuple(DRY_SWAP.get(o, o) for o in switch
                           if DRY_SWAP.get(o, o) is not None and not o.startswith("bench.warmup="))
        if lacking:
            skipped.append({"workload": workload, "switches": name, "why": f"not in this checkout: {lacking}"})
        elif args.dry_run and "trainer.precision=fp8" in switch:  # the dry run's fp32 would replace it
            skipped.append({"workload": workload, "switches": name, "why": "dry run: float8 needs a GPU of sm_89+"})
        elif args.dry_run and (workload, switch) in dry_seen:
            skipped.append({"workload": workload, "switches": name,
                            "why": f"dry run: as {dry_seen[workload, switch]} on a CPU"})
        else:
            dry_seen.setdefault((workload, switch), name)
            keep = [f"bench.trace={kept_files(args.out, workload, name)['trace']}"] \
                if (workload, name) in kept and "bench.trace" in keys else []
            todo.append((workload, name, [*WORKLOADS[workload], *COMMON, *switch, *(DRY if args.dry_run else ()),
                                          *keep]))
    return todo, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "outputs" / f"bench-gpu-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests-only", action="store_true", help="the GPU tier alone, given the whole budget")
    p.add_argument("--only", choices=["base", "big", "multi30k"], help="workloads of one model only")
    p.add_argument("--sets", type=lambda v: v.split(","), help="these switch sets only, comma-separated")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting runs after this many seconds")
    p.add_argument("--run-timeout-s", type=float, default=240.0,
                   help="the longest one run may take (compile and CUDA graph captures included)")
    p.add_argument("--start-at", metavar="WORKLOAD:SET",
                   help="begin PLAN at this run, without HEAD's runs and the loss benchmark before it: a further "
                        "call of a lease goes on where the last stopped (its summary's 'To go on' line names the run)")
    p.add_argument("--tier-workers", type=int, help="GPU tests at a time (pytest-xdist); default: 4 on a machine "
                   "of 16 cores with xdist, else 1")
    p.add_argument("--switch", action="append", help="an extra switch set, name=key=value,key=value (16k runs)")
    p.add_argument("--decode-checkpoint", type=Path, help="time decoding with this trained checkpoint")
    p.add_argument("--dry-run", action="store_true", help="on a CPU, everything shrunk: tests the plumbing")
    p.add_argument("--compile-cache", type=Path, metavar="ARCHIVE",
                   help="torch.compile's caches from an earlier lease (the .compile-cache.tar.gz this option wrote "
                        "beside --out), unpacked before the runs; after them, this call's are packed beside --out")
    args = p.parse_args(argv)
    unknown = [n for n in args.sets or [] if n not in switch_sets(args)]
    if unknown:
        p.error(f"--sets: no switch set named {', '.join(unknown)} (SWITCH_SETS or a --switch)")
    cache = None
    if args.compile_cache:  # before anything is written; every run inherits the directory, TORCHINDUCTOR_CACHE_DIR
        try:
            cache = compile_cache.use(args.compile_cache)
        except ValueError as e:
            p.error(f"--compile-cache: {e}")
    todo, skipped = plan(args, config_keys()) if not args.tests_only else ([], [])
    if args.start_at:
        names = [f"{w}:{n}" for w, n, _ in todo]
        if args.start_at not in names:
            p.error(f"--start-at: {args.start_at} is not a run of this call's plan (WORKLOAD:SET, as the last call's "
                    f"'to go on' line names it; the plan begins {', '.join(names[:3])}, ...)")
        todo = todo[names.index(args.start_at):]
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA GPU (--dry-run tests the script on a CPU)", file=sys.stderr)
        return 2
    start = time.time()
    log = args.out.with_suffix(".log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = {"kind": "machine", "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
              "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commit": commit(), "dry_run": args.dry_run}
    append(args.out, header)
    if cache is not None:
        append(args.out, cache)
    os.environ["BENCH_COMMIT"] = header["commit"]  # transformer-bench's records name it too (no .git on a copy)
    if args.tests_only:  # a second call of a lease: the tier alone
        code = run_tests(args.out, log, timeout=args.budget_s, dry=args.dry_run, workers=args.tier_workers)
        if args.compile_cache:
            append(args.out, compile_cache.keep(args.out))
        return 0 if args.dry_run and code == 5 else code
    records, left_out = [], []  # left_out: runs the budget cut or never started, for a further call

    def run_all(entries) -> None:
        for i, (workload, name, overrides) in enumerate(entries):
            left = args.budget_s - (time.time() - start)
            if left < 30:
                for w, n, _ in entries[i:]:
                    left_out.append(f"{w}:{n}")
                    skipped.append({"workload": w, "switches": n, "why": "over the time budget"})
                    append(args.out, {"kind": "bench", "workload": w, "switches": n,
                                      "skipped": "over the time budget"})
                return
            timeout = min(left, args.run_timeout_s)
            r = run_bench(workload, name, overrides, args.out, log, timeout=timeout)
            if r is not None:
                records.append(r)
            elif timeout == args.run_timeout_s:
                skipped.append({"workload": workload, "switches": name, "why": "failed (see the log)"})
            else:  # a run the budget's end cut short need not have failed: say so
                left_out.append(f"{workload}:{name}")
                why = f"failed or cut at the budget's end ({timeout:.0f} s; see the log)"
                skipped.append({"workload": workload, "switches": name, "why": why})

    head = [entry for entry in todo if (entry[0], entry[1]) in HEAD]
    run_all(head)
    loss_text = run_loss(args.out, log, dry=args.dry_run) if not args.start_at else ""
    code = 0
    if not args.skip_tests:  # the tier gets what is left of half the budget, at least 150 s
        left = args.budget_s - (time.time() - start)
        code = run_tests(args.out, log, timeout=max(150.0, min(240.0, args.budget_s / 2, left - 30)),
                         dry=args.dry_run, workers=args.tier_workers)
        code = 0 if args.dry_run and code == 5 else code
    run_all([entry for entry in todo if entry not in head])
    multi30k = Path(os.environ.get("MULTI30K_DIR") or REPO.parent / "shared" / "data" / "multi30k")
    if args.dry_run:
        pass
    elif (multi30k / "test_2016_flickr.de.gz").is_file() and args.budget_s - (time.time() - start) > 60:
        run_decode(args.out, args.decode_checkpoint)
    else:
        print(f"decoding: skipped (no Multi30k in {multi30k}, set MULTI30K_DIR, or no time left)")
    if args.compile_cache:
        append(args.out, compile_cache.keep(args.out))
    summary = markdown(header, records, skipped, loss_text=loss_text)
    if left_out:
        summary += f"\n\nTo go on: `--skip-tests --start-at {left_out[0]}` ({len(left_out)} runs left)."
        append(args.out, {"kind": "go_on", "start_at": left_out[0], "runs_left": len(left_out)})
    args.out.with_suffix(".md").write_text(summary + "\n")
    print("\n" + summary)
    print(f"\nresults: {args.out}, {args.out.with_suffix('.md')}, log {log} ({time.time() - start:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
