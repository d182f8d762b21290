"""benchmarks/compile_cache.py: torch.compile's caches packed on one machine and found again on the next."""
import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from tests.helpers.benchmarks import load_benchmark
from tests.helpers.cli import cli_env

compile_cache = load_benchmark("compile_cache")


def fill(directory, sizes: dict) -> None:
    for rel, size in sizes.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))  # random: no compression, so sizes decide the fallback


def test_a_packed_cache_unpacks_where_it_was_packed_from(tmp_path):
    cache = tmp_path / "inductor"
    fill(cache, {"fxgraph/ab/entry": 3000, "triton/0/K1/k.cubin": 2000, "triton/0/K1/__grp__k.json": 100,
                 "aotautograd/x/entry": 500})
    before = {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    archive = tmp_path / "out" / "b.compile-cache.tar.gz"
    result = compile_cache.pack(cache, archive)
    assert result["saved"] and result["files"] == 4 and result["dropped"] is None
    assert result["bytes"] == archive.stat().st_size and [p.name for p in archive.parent.iterdir()] == [archive.name]
    with tarfile.open(archive) as tar:  # where it was packed from, recorded for the unpack
        assert tar.extractfile(compile_cache.WHERE).read().decode() == str(cache)
    shutil.rmtree(cache)  # a fresh machine
    got = compile_cache.unpack(archive)
    assert got == {"dir": str(cache), "files": 4, "bytes": archive.stat().st_size}
    assert {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before


def test_an_archive_over_the_limit_drops_tritons_intermediate_forms_then_its_cache(tmp_path):
    """Nothing is written when even inductor's own entries are over the limit."""
    cache = tmp_path / "c"
    fill(cache, {"fxgraph/e": 20_000, "triton/0/K/k.cubin": 20_000, "triton/0/K/k.ptx": 40_000,
                 "triton/0/K/k.llir": 40_000})
    out = tmp_path / "a.tar.gz"
    assert compile_cache.pack(cache, out, limit=200_000)["dropped"] is None
    r = compile_cache.pack(cache, out, limit=60_000)
    assert r["saved"] and r["dropped"] == "Triton's intermediate forms" and r["files"] == 2
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == [".cache_dir", "fxgraph/e", "triton/0/K/k.cubin"]
    r = compile_cache.pack(cache, out, limit=30_000)
    assert r["saved"] and r["dropped"] == "Triton's own cache" and r["files"] == 1
    out.unlink()
    r = compile_cache.pack(cache, out, limit=10_000)
    assert not r["saved"] and "over 10,000 bytes" in r["why"] and not out.exists()
    assert not compile_cache.pack(tmp_path / "none", out)["saved"] and not out.exists()


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "link"])
def test_unpack_refuses_members_outside_the_cache(tmp_path, name):
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        where = str(tmp_path / "cache").encode()
        info = tarfile.TarInfo(".cache_dir")
        info.size = len(where)
        tar.addfile(info, io.BytesIO(where))
        info = tarfile.TarInfo(name)
        if name == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match=f"member '{name}' is not a plain file"):
        compile_cache.unpack(archive)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "escape").exists()


def test_unpack_names_an_archive_that_is_no_compile_cache(tmp_path):
    archive = tmp_path / "x.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("something"), io.BytesIO(b""))
    with pytest.raises(ValueError, match=r"x.tar.gz: not a compile cache archive"):
        compile_cache.unpack(archive)
    archive.write_text("not a tar file")
    with pytest.raises(ValueError, match=r"x.tar.gz: not a compile cache archive"):
        compile_cache.use(archive)


def test_kept_files_stay_within_what_a_device_call_brings_back():
    """A device-tool call brings back 8 files: the records, the summary and the log, the GPU tier's report unless
    --skip-tests, the compile cache's archive; the KEEP runs' timelines (and compiled code) take what is left, in
    KEEP's order."""
    bench_gpu = load_benchmark("bench_gpu")
    layers, whole, eager = bench_gpu.KEEP

    def kept(**kw):
        return bench_gpu.kept_runs(argparse.Namespace(**{"dry_run": False, "skip_tests": True,
                                                         "compile_cache": None, **kw}))
    assert kept() == {layers, whole, eager}  # 3 + 2 + 2 + 1
    assert kept(compile_cache="c.tar.gz") == {layers, whole}  # 4 + 2 + 2
    assert kept(compile_cache="c.tar.gz", skip_tests=False) == {layers, eager}  # 5 + 2 + 1
    assert kept(compile_cache="c.tar.gz", skip_tests=False, dry_run=True) == {layers, whole, eager}  # no code


@pytest.mark.slow
def test_a_compiled_run_finds_the_carried_cache_on_a_fresh_machine(tmp_path, monkeypatch):
    """transformer-bench compiled: the first run compiles its graphs anew (misses, no hits); its cache packed,
    the directory deleted as on a fresh machine, unpacked by `use`, the same run finds every graph there."""
    cache, out = tmp_path / "inductor", tmp_path / "out" / "b.jsonl"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert compile_cache.use(tmp_path / "none.tar.gz")["dir"] == str(cache)
    run = ["model=tiny", "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "bench.synthetic=true",
           "bench.sentences=200", "bench.vocab_size=300", "bench.max_len=30", "data.max_tokens=400",
           "bench.warmup=2", "bench.steps=2", "bench.repeats=1", "bench.profile_steps=1", "trainer.progress=false",
           "trainer.compile=true",
           # fp32: under bf16 autocast on a CPU the attention's fp32 region (layers._cpu_fp32_attention) puts
           # _enter_autocast in the graph, and AOTAutograd's cache bypasses such graphs (torch 2.13): every
           # compiled bf16 CPU run compiles its joint graph anew. GPUs and fp32 CPUs cache it.
           "trainer.precision=fp32"]

    def bench() -> dict:
        res = subprocess.run([sys.executable, "-m", "transformer.cli.bench", *run], cwd=tmp_path,
                             env={**cli_env(), "TORCHINDUCTOR_CACHE_DIR": str(cache)}, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "compile cache" in res.stdout
        return json.loads(res.stdout.strip().splitlines()[-1])["compile_cache"]
    first = bench()
    assert first["hits"] == 0 and first["misses"] >= 2 and first["aot_misses"] >= 1  # forward and backward
    kept = compile_cache.keep(out)
    assert kept["saved"] and kept["archive"] == str(out.parent / "b.compile-cache.tar.gz")
    shutil.rmtree(cache)
    got = compile_cache.use(out.parent / "b.compile-cache.tar.gz")
    assert got["dir"] == str(cache) and got["files"] == kept["files"]
    second = bench()
    assert second["misses"] == 0 and second["hits"] == first["misses"] and second["aot_hits"] >= 1
