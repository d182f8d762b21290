"""torch.compile's on-disk caches carried from one GPU machine to the next (`bench_gpu.py --compile-cache`).

A lent GPU machine starts bare, so every compiled run of `make bench-gpu` compiled from nothing, a large share of
a short lease each (docs/benchmarks/cpu-checks-of-gpu-paths.md). Inductor keeps what it compiles in one directory
(TORCHINDUCTOR_CACHE_DIR: its compiled graphs, AOTAutograd's, the generated kernels, and Triton's binaries under
triton/); packed into one archive that the device tool brings back (at most 16 MiB a file) and carried to the
next lease, a run whose graphs and kernels are unchanged finds them there instead of compiling them again.

Triton's cache records its files by absolute path, so the archive names the directory it was packed from and is
unpacked there again.
"""
import io
import os
import tarfile
import tempfile
from pathlib import Path

LIMIT = 16 * 2**20  # the largest file the device tool brings back
DEFAULT_DIR = Path("/tmp/transformer-compile-cache")
WHERE = ".cache_dir"  # the archive's member naming the directory it was packed from
# Triton's intermediate forms of a kernel: a cached kernel loads from its binary and metadata alone
# (triton.compiler.CompiledKernel; inductor reads the PTX only where it is there), so they go first when the
# archive is over the limit
INTERMEDIATE = (".ttir", ".ttgir", ".llir", ".ptx", ".source", ".amdgcn")
DROPS = {"nothing": None, "intermediate": "Triton's intermediate forms", "triton": "Triton's own cache"}


def _not_ours(archive: Path) -> ValueError:
    return ValueError(f"{archive}: not a compile cache archive (no {WHERE} member)")


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive)
    except tarfile.TarError:
        raise _not_ours(archive) from None


def _where(archive: Path, tar: tarfile.TarFile) -> Path:
    try:
        return Path(tar.extractfile(WHERE).read().decode().strip())
    except (KeyError, AttributeError):  # no such member; not a file
        raise _not_ours(archive) from None


def unpack(archive: Path) -> dict:
    """Unpacks `archive` into the directory it was packed from (created where missing); returns what it held.
    Raises ValueError naming the archive when pack() did not write it, and the member for anything but plain
    files and folders under that directory."""
    with _open(archive) as tar:
        directory = _where(archive, tar)
        members = [m for m in tar.getmembers() if m.name != WHERE]
        for m in members:
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"{archive}: member {m.name!r} is not a plain file or folder inside the cache")
        directory.mkdir(parents=True, exist_ok=True)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python's own check as well
        for m in members:
            tar.extract(m, directory, set_attrs=False, **safe)
    files = sum(m.isfile() for m in members)
    return {"dir": str(directory), "files": files, "bytes": archive.stat().st_size}


def _files(directory: Path, drop: str) -> list:
    """The files to pack: all of them, or (drop) without Triton's intermediate forms, or without triton/."""
    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(directory)
        if drop in ("intermediate", "triton") and path.suffix in INTERMEDIATE:
            continue
        if drop == "triton" and rel.parts[0] == "triton":
            continue
        out.append(rel)
    return out


def _archive(directory: Path, files: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        where = str(directory).encode()
        info = tarfile.TarInfo(WHERE)
        info.size = len(where)
        tar.addfile(info, io.BytesIO(where))
        for rel in files:
            try:
                tar.add(directory / rel, arcname=str(rel), recursive=False)
            except OSError:  # a file a still-running compile worker removed: the cache does without it
                continue
    return buf.getvalue()


def pack(directory: Path, archive: Path, limit: int = LIMIT) -> dict:
    """Packs `directory` into `archive` (gzip'd tar), whole if it fits in `limit` bytes, else without Triton's
    intermediate forms, else without Triton's own cache (inductor's compiled graphs carry their kernels' binaries
    too); written whole or not at all. Returns {"saved", "bytes", "files", "dropped"}."""
    directory = Path(os.path.abspath(directory))  # as Triton records it: links not followed
    if not directory.is_dir():
        return {"saved": False, "bytes": 0, "files": 0, "dropped": None, "why": f"no directory {directory}"}
    for drop in DROPS:
        files = _files(directory, drop)
        data = _archive(directory, files)
        if len(data) <= limit:
            break
    else:
        return {"saved": False, "bytes": len(data), "files": len(files), "dropped": DROPS[drop],
                "why": f"over {limit:,} bytes even without Triton's cache"}
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=archive.parent, prefix=archive.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, archive)
    return {"saved": True, "bytes": len(data), "files": len(files), "dropped": DROPS[drop]}


def use(archive: Path) -> dict:
    """Points this process and the runs it starts (TORCHINDUCTOR_CACHE_DIR) at the directory `archive` was packed
    from, with its files, when there is such an archive, else at the environment's or DEFAULT_DIR. Returns the
    record of what it did; ValueError as unpack()'s, before anything is unpacked."""
    record = {"kind": "compile_cache", "archive": str(archive)}
    if archive.is_file():
        record.update(unpack(archive))
        print(f"compile cache: {record['files']} files from {archive} into {record['dir']}", flush=True)
    else:
        record["dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(DEFAULT_DIR)
        print(f"compile cache: no {archive} yet; this call's caches go beside --out", flush=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = record["dir"]
    return record


def keep(out: Path) -> dict:
    """The caches of the runs since use(), packed beside `out` (<stem>.compile-cache.tar.gz, a name the device
    tool brings back) for the next lease. Returns the record of what it did."""
    archive = out.with_name(out.stem + ".compile-cache.tar.gz")
    result = pack(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), archive)
    size = f"{result['bytes'] / 2**20:.1f} MiB, {result['files']} files"
    print(f"compile cache: {archive} ({size}{', without ' + result['dropped'] if result['dropped'] else ''})"
          if result["saved"] else f"compile cache: not kept ({result['why']}; {size})", flush=True)
    return {"kind": "compile_cache", "archive": str(archive), **result}
