"""`make bench-gpu`: the GPU test tier, then transformer-bench for model=base and model=big at a few
data.max_tokens, then decoding speed when Multi30k is at hand (a trained checkpoint's, with --decode-checkpoint; else a
random model on spaCy vocabularies, which needs spaCy). Prints a Markdown table (for docs/performance.md)
and appends every record, one JSON object a line, to --out. Uses the interpreter it runs under: a
machine's own CUDA torch, with this package importable from the repository (no install, no download).

    python benchmarks/bench_gpu.py --out outputs/bench-gpu.jsonl [--skip-tests] [--only base]
        [--decode-checkpoint RUN/checkpoints/best.pt]
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (model, data.max_tokens, extra overrides): bf16 autocast is the default where the GPU has it.
RUNS = [
    ("base", 4096, ()), ("base", 16384, ()), ("base", 16384, ("trainer.compile=true",)),
    ("big", 4096, ()), ("big", 16384, ()), ("big", 16384, ("trainer.compile=true",)),
    ("big", 32768, ("trainer.activation_checkpointing=true",)),
]
SYNTHETIC = ("bench.synthetic=true", "bench.warmup=8", "bench.steps=30", "trainer.progress=false")


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def append(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_tests(out: Path) -> int:
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs"],
                         cwd=REPO, env=env(), capture_output=True, text=True)
    print(res.stdout[-6000:], res.stderr[-2000:], sep="\n", flush=True)
    summary = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
    append(out, {"kind": "gpu_tests", "returncode": res.returncode, "summary": summary,
                 "seconds": round(time.time() - t0, 1)})
    return res.returncode


def run_bench(model: str, max_tokens: int, extra: tuple, out: Path):
    overrides = [f"model={model}", f"data.max_tokens={max_tokens}", *SYNTHETIC, *extra]
    print(f"--- transformer-bench {' '.join(overrides)}", flush=True)
    res = subprocess.run([sys.executable, "-m", "transformer.cli.bench", *overrides], cwd=REPO, env=env(),
                         capture_output=True, text=True)
    if res.returncode != 0:  # out of memory at a large max_tokens, say: recorded, and the others still run
        print(res.stderr[-3000:], flush=True)
        append(out, {"kind": "bench", "overrides": overrides, "returncode": res.returncode,
                     "error": (res.stderr.strip().splitlines() or [""])[-1]})
        return None
    print("\n".join(res.stdout.strip().splitlines()[:-1]), flush=True)
    record = json.loads(res.stdout.strip().splitlines()[-1])
    record.update(kind="bench", overrides=overrides, options=list(extra))
    append(out, record)
    return record


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


def markdown(records) -> str:
    rows = ["| model | max_tokens | compute | options | target tok/s | step ms | fwd+bwd ms | optimizer ms | "
            "peak GiB | TFLOP/s | MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        options = " ".join(r["options"]) or "-"
        rows.append(f"| {r['overrides'][0][6:]} | {r['max_tokens']} | {r['compute']} | {options} | "
                    f"{r['tgt_tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['forward_backward_ms']:.1f} | "
                    f"{r['optimizer_ms']:.1f} | {r['peak_mem_gb']:.1f} | {r['achieved_tflops']:.3g} | {mfu} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "outputs" / f"bench-gpu-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--only", choices=["base", "big"], help="benchmark one model size only")
    p.add_argument("--decode-checkpoint", type=Path, help="time decoding with this trained checkpoint")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    start = time.time()
    append(args.out, {"kind": "machine", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    code = 0 if args.skip_tests else run_tests(args.out)
    records = [r for m, tokens, extra in RUNS if args.only in (None, m)
               if (r := run_bench(m, tokens, extra, args.out)) is not None]
    multi30k = Path(os.environ.get("MULTI30K_DIR") or REPO.parent / "shared" / "data" / "multi30k")
    if (multi30k / "test_2016_flickr.de.gz").is_file():
        run_decode(args.out, args.decode_checkpoint)
    else:
        print(f"decoding: skipped (no Multi30k in {multi30k}; set MULTI30K_DIR)")
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"bf16 unless noted, synthetic batches (lengths ~ N(27, 12), vocab 32000)\n")
    print(markdown(records))
    print(f"\nresults: {args.out} ({time.time() - start:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
