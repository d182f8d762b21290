"""Running things on a short GPU lease, for `benchmarks/bench_gpu.py`: commands that lead their own process group
(a timeout or Ctrl-C ends them whole), the records' JSON lines, and the GPU test tier (`pytest -m gpu`, newest GPU
code first, several tests at a time where the machine allows), whose outcomes are kept test by test so that a
tier cut short by the lease's clock still says what passed and what failed."""
import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

# The GPU test tier, the files of the newest GPU code first: what a short lease must check before the rest.
TIER_FIRST = ("test_packed.py", "test_graphs.py", "test_varlen.py", "test_loss_optim.py", "test_residual.py",
              "test_microbatch.py", "test_fp8.py", "test_gpu.py")


def run_group(cmd, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw), with the command leading a process
    group that a timeout or Ctrl-C kills whole: pytest-xdist's workers, loader workers and inductor's compile
    workers would otherwise keep the GPU busy through the runs after it. A group, not a session: the device tool
    ends what a call leaves running by session, and a process in a new one would outlive the call."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=os.setpgrp,
                          **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            try:  # what it printed before; a child outside the group that holds the pipes cannot stall us
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        except BaseException:
            kill_group(proc.pid)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tier_workers() -> int:
    """pytest-xdist processes for the GPU tier: a lent machine (16 cores, one GPU of 139 GiB, xdist installed)
    runs four of the tier's small tests at a time; serial where xdist is missing or cores are few."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def tier_command(files: list, timeout: float, workers: int) -> list:
    """pytest over `files` for the gpu marker; with workers > 1, pytest-xdist hands tests out in the files' order.
    With pytest-timeout (the lent machines have it) no single test may take more than a third of the tier, or half
    of it when others run beside it (then a slow one holds up one worker only, and runs slower for the sharing)."""
    share = 3 if workers <= 1 else 2
    per_test = ["--timeout", str(int(max(60.0, timeout / share)))] if importlib.util.find_spec("pytest_timeout") \
        else []
    parallel = ["-n", str(workers)] if workers > 1 else []
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs", *per_test,
            *parallel, *files]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def append(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_tests(out: Path, log: Path, timeout: float, dry: bool, workers: Optional[int] = None) -> int:
    """The GPU tier, newest GPU code first, `workers` tests at a time (tier_workers() by default). Each test's
    outcome is written as it ends (tests/conftest.py's TRANSFORMER_TEST_LOG), so a tier cut short by `timeout`
    still reports what passed, what failed and why."""
    t0 = time.time()
    found = {f.name: str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")}
    files = [found[name] for name in TIER_FIRST if name in found]
    files += sorted(path for name, path in found.items() if name not in TIER_FIRST)
    workers = tier_workers() if workers is None else workers
    cmd = tier_command(files, timeout, workers)
    report = out.with_suffix(".tests.jsonl")
    report.unlink(missing_ok=True)
    try:
        res = run_group(cmd, cwd=REPO, env={**env(), "TRANSFORMER_TEST_LOG": str(report)}, timeout=timeout)
        code, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"{e.stdout or ''}\ntimed out after {timeout:.0f} s"
    results = [json.loads(x) for x in report.read_text().splitlines()] if report.is_file() else []
    counts = collections.Counter(r["outcome"] for r in results)
    failed = [r for r in results if r["outcome"] == "failed"]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ended"
    if code == 124:
        summary += f"; timed out after {timeout:.0f} s"
    with open(log, "a") as f:
        f.write(f"--- pytest -m gpu\n{text}\n")
        f.writelines(f"--- FAILED {r['test']}\n{r['error']}\n" for r in failed)
    print(f"gpu tier: {summary} ({time.time() - t0:.0f} s, {workers} at a time)", flush=True)
    for r in failed:
        print(f"  FAILED {r['test']}: {r['error'].strip().splitlines()[-1][:300]}", flush=True)
    # No CUDA here (a dry run): the tier skips every test, pytest's code 5 when all are deselected or skipped.
    append(out, {"kind": "gpu_tests", "returncode": code, "summary": summary, "seconds": round(time.time() - t0, 1),
                 "workers": workers, "tests": results, "dry_run": dry})
    return code
