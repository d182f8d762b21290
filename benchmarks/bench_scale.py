"""WMT-size data in bounded memory: prints measured numbers, asserts nothing.

    python benchmarks/bench_scale.py --pairs 1000000 [--workers 2] [--multi30k DIR] [--work DIR] [--keep]

A synthetic corpus of N pairs is made from Multi30k (each line joins two random training pairs: about 25
words a sentence, as in issue 12), then, with tokenizer=bpe:
1. `transformer-preprocess` wall time and CPU time (user + system, all processes), and peak memory: of the
   main process (VmHWM) and of the whole process tree (sum of the PSS of every process, sampled every 0.25 s);
2. the epoch batch plan of all N pairs (TokenBatchSampler.epoch_batches) for 1 and 8 workers;
3. `transformer-train data.preprocessed=DIR trainer.devices=2 trainer.accelerator=cpu model=tiny`: time from
   start to the first optimiser step, and each rank's RSS (and peak RSS) at that step, against the same run
   on a 1,000-pair folder with the same vocabulary ("empty data"), alternated --repeats times; and the data
   pipeline's own share of that time, measured in one process (open + verify, plan, first batch);
4. spaCy preprocessing throughput (sentences/s per worker) on a smaller corpus (--spacy-pairs).
The load average of the machine is printed beside each measurement: other jobs slow everything down.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from transformer.data.corpus import read_parallel  # noqa: E402


def loadavg() -> str:
    return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def make_corpus(multi30k: Path, n: int, folder: Path, seed: int = 0) -> list:
    """train.{de,en}: n lines, each two random Multi30k training pairs joined; val = Multi30k val."""
    src, tgt = read_parallel(multi30k / "train.de.gz", multi30k / "train.en.gz")
    src, tgt = np.array(src, dtype=object), np.array(tgt, dtype=object)
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.de", "w", encoding="utf-8") as fs, open(folder / "train.en", "w", encoding="utf-8") as ft:
        for a in range(0, n, 100_000):
            pick = rng.integers(0, len(src), size=(min(n, a + 100_000) - a, 2))
            fs.write("".join(f"{x} {y}\n" for x, y in zip(src[pick[:, 0]], src[pick[:, 1]], strict=False)))
            ft.write("".join(f"{x} {y}\n" for x, y in zip(tgt[pick[:, 0]], tgt[pick[:, 1]], strict=False)))
    for lang in ("de", "en"):
        shutil.copy(multi30k / f"val.{lang}.gz", folder / f"val.{lang}.gz")
    return ["data=files", f"data.files.train={folder / 'train'}", f"data.files.val={folder / 'val'}"]


# ---- memory of a process tree, from /proc -------------------------------------------------------------------
def _status(pid: int, key: str) -> int:
    """kB of a /proc/PID/status or smaps_rollup field (0 once the process is gone)."""
    for name in ("status", "smaps_rollup"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1])
        except OSError:
            return 0
    return 0


def tree(pid: int) -> list:
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def run_sampled(cmd: list, cwd: Path, until=None, interval: float = 0.25) -> dict:
    """Runs `cmd`, sampling the tree's summed PSS and the main process's VmHWM; `until(proc)` may return a dict
    to record (and then the run is stopped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_tree = peak_main = 0
    extra = None
    while proc.poll() is None:
        pids = tree(proc.pid)
        peak_tree = max(peak_tree, sum(_status(p, "Pss") for p in pids))
        peak_main = max(peak_main, _status(proc.pid, "VmHWM"))
        if until is not None and extra is None:
            extra = until(proc, time.time() - t0)
            if extra is not None:
                proc.terminate()
        time.sleep(interval)
    out, err = proc.communicate()
    if proc.returncode != 0 and extra is None:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the tree that was waited for
    return {"seconds": time.time() - t0, "peak_tree_mb": peak_tree / 1024, "peak_main_mb": peak_main / 1024,
            "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "stdout": out, "stderr": err, "extra": extra}


def bench_preprocess(data: list, out: Path, workers: int, tokenizer: str, work: Path) -> dict:
    cmd = [sys.executable, "-m", "transformer.cli.preprocess", *data, f"tokenizer={tokenizer}",
           f"preprocess.out_dir={out}", f"preprocess.workers={workers}", "preprocess.progress=false"]
    before, cores = loadavg(), len(os.sched_getaffinity(0))
    r = run_sampled(cmd, work)
    m = json.loads((out / "manifest.json").read_text())
    pairs = m["splits"]["train"]["lines"]
    print(f"preprocess tokenizer={tokenizer} {pairs} pairs, {workers} worker(s): {r['seconds']:.1f} s wall, "
          f"{r['cpu_s']:.0f} CPU-s (with this machine's {cores} cores to itself: >= {r['cpu_s'] / cores:.0f} s) | peak "
          f"RSS main process {r['peak_main_mb']:.0f} MB, whole process tree (PSS) {r['peak_tree_mb']:.0f} MB | "
          f"{2 * pairs / r['seconds'] / workers:,.0f} sentences/s per worker | {before} -> {loadavg()}")
    print("   ", r["stdout"].strip().splitlines()[0])
    for line in r["stderr"].splitlines():  # the phases' own timings
        if any(k in line for k in ("checked the input", "ready (", "encoded ", "learning BPE")):
            print("   ", line.strip())
    return m


def bench_plan(out: Path) -> None:
    from transformer.data.batch import Ragged
    from transformer.data.sampler import TokenBatchSampler
    sizes = [Ragged.open(out / f"train.{s}.tokens.npy", out / f"train.{s}.offsets.npy").lengths + 1
             for s in ("src", "tgt")]
    for world_size in (1, 8):
        sampler = TokenBatchSampler(*sizes, max_tokens=4096, seed=1, world_size=world_size)
        t0 = time.perf_counter()
        batches = sampler.epoch_batches(0)
        dt = time.perf_counter() - t0
        print(f"epoch batch plan, {len(sizes[0])} pairs, max_tokens=4096, world_size={world_size}: {dt:.2f} s, "
              f"{len(batches)} batches | {loadavg()}")


def first_step(data: list, folder: Path, work: Path, name: str) -> dict:
    """A 2-worker CPU run from `folder`, stopped at its first optimiser step."""
    run_dir = work / f"run-{name}"
    cmd = [sys.executable, "-m", "transformer.train", *data, f"data.preprocessed={folder}", "model=tiny",
           "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=1000", "trainer.log_every=1",
           "trainer.val_every=100000", "checkpoint.every_steps=100000", "eval.bleu=false", "trainer.progress=false",
           f"hydra.run.dir={run_dir}"]

    def at_first_step(proc, elapsed):
        metrics = run_dir / "metrics.jsonl"
        if not (metrics.exists() and '"train"' in metrics.read_text()):
            return None
        ranks = [p for p in tree(proc.pid) if p != proc.pid and b"spawn_main" in _cmdline(p)]
        return {"seconds": elapsed, "rss": [_status(p, "VmRSS") / 1024 for p in ranks],
                "hwm": [_status(p, "VmHWM") / 1024 for p in ranks]}

    r = run_sampled(cmd, work, until=at_first_step, interval=0.05)
    if r["extra"] is None:
        sys.exit(f"no training step seen: {r['stderr'][-3000:]}")
    return r["extra"]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def bench_training(data: list, folder: Path, work: Path, manifest: dict, repeats: int) -> None:
    from omegaconf import OmegaConf

    from transformer.data.preprocess import Options, preprocess
    small = work / "small"
    small.mkdir(exist_ok=True)
    for lang in ("de", "en"):  # the first 1,000 pairs, with the big folder's tokenizer: the same model
        with open(work / "corpus" / f"train.{lang}", encoding="utf-8") as f:
            (small / f"train.{lang}").write_text("".join(next(f) for _ in range(1000)), encoding="utf-8")
    cfg = OmegaConf.create(manifest["config"])
    empty = preprocess(cfg, {"train": (small / "train.de", small / "train.en"),
                             "valid": (work / "corpus" / "val.de.gz", work / "corpus" / "val.en.gz")},
                       work / "bin-empty", Options(progress=False), tokenizer_state=manifest["tokenizer"])
    results = {"empty": [], "full": []}
    for k in range(repeats):  # alternated, so a change in machine load hits both alike
        for name, path in (("empty", empty), ("full", folder)):
            before = loadavg()
            results[name].append(first_step(data, path, work, f"{name}{k}"))
            r = results[name][-1]
            print(f"train from {name} folder, 2 CPU workers: first step {r['seconds']:.1f} s after start | RSS per "
                  f"rank at the first step {', '.join(f'{x:.0f}' for x in r['rss'])} MB (peak so far "
                  f"{', '.join(f'{x:.0f}' for x in r['hwm'])} MB) | {before} -> {loadavg()}")
    extra = [max(f["hwm"][i] for f in results["full"]) - min(e["hwm"][i] for e in results["empty"]) for i in (0, 1)]
    print(f"each rank's peak RSS above the empty-data run (largest full minus smallest empty): "
          f"{', '.join(f'{x:.0f}' for x in extra)} MB ({manifest['splits']['train']['pairs']} pairs)")


def bench_data_setup(folder: Path) -> None:
    """The data pipeline's own share of the time to the first step, in one process: open and verify the
    folder (sha256 of every file, as global rank 0 does), plan the epoch, collate the first batch."""
    code = ("import sys, time; t0 = time.time(); sys.path.insert(0, sys.argv[1])\n"
            "from omegaconf import OmegaConf\n"
            "from transformer.data.config import DataConfig, TokenizerConfig\n"
            "from transformer.data.translation import build_translation_data\n"
            "from transformer.dist import DistEnv\n"
            "cfg = OmegaConf.create({'data': OmegaConf.structured(DataConfig(name='files', preprocessed=sys.argv[2])),"
            " 'tokenizer': OmegaConf.structured(TokenizerConfig()), 'seed': 1})\n"
            "t1 = time.time(); dm = build_translation_data(cfg, DistEnv(), None); t2 = time.time()\n"
            "n = dm.num_train_batches(0); t3 = time.time(); next(iter(dm.train_loader(0))); t4 = time.time()\n"
            "print(f'{t1 - t0:.1f} {t2 - t1:.1f} {t3 - t2:.2f} {t4 - t3:.3f}')")
    before = loadavg()
    out = subprocess.run([sys.executable, "-c", code, str(REPO), str(folder)], capture_output=True, text=True,
                         check=True).stdout.split()
    print(f"data setup in one process: imports {out[0]} s, open + verify every sha256 {out[1]} s, epoch plan "
          f"{out[2]} s, first batch {out[3]} s | {before} -> {loadavg()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--multi30k", default=os.environ.get("MULTI30K_DIR") or str(REPO.parent / "shared/data/multi30k"))
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--spacy-pairs", type=int, default=100_000, help="0 skips the spaCy measurement")
    p.add_argument("--work", help="working folder (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--repeats", type=int, default=2, help="runs of each first-step measurement (alternated)")
    args = p.parse_args()
    if not (Path(args.multi30k) / "train.de.gz").exists():
        sys.exit(f"no Multi30k files in {args.multi30k} (--multi30k DIR)")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, {loadavg()}, work folder {work}")
    try:
        t0 = time.time()
        data = make_corpus(Path(args.multi30k), args.pairs, work / "corpus")
        size = sum((work / "corpus" / f"train.{lang}").stat().st_size for lang in ("de", "en")) / 2**20
        print(f"synthetic corpus: {args.pairs} pairs, {size:.0f} MiB of text, made in {time.time() - t0:.0f} s")
        manifest = bench_preprocess(data, work / "bin", args.workers, "bpe", work)
        bench_plan(work / "bin")
        if not args.skip_train:
            bench_data_setup(work / "bin")
            bench_training(data, work / "bin", work, manifest, args.repeats)
        if args.spacy_pairs:
            spacy_data = make_corpus(Path(args.multi30k), args.spacy_pairs, work / "corpus-spacy")
            bench_preprocess(spacy_data, work / "bin-spacy", args.workers, "spacy", work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
