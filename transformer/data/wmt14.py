"""WMT14 English-German, the paper's data (Section 5.1): download, extraction, cleaning.

The sets of fairseq's `prepare-wmt14en2de.sh --icml17`: training data europarl-v7, commoncrawl and
news-commentary-v9 (about 4.5M pairs); newstest2013 for validation; newstest2014 (the full 3,003-sentence
set, as sacreBLEU's wmt14/full) for test. Either direction: data.src_lang / data.tgt_lang in {en, de}.

Everything lands under ROOT/wmt14 (ROOT = data.root or the user's cache dir):
    archives/      the .tgz files as downloaded (resumed after an interruption; see download.fetch)
    raw/           the archive members we use, extracted
    train.{de,en}  the three training corpora concatenated and cleaned (below)
    newstest2013.{de,en}, newstest2014-{src,ref}.{de,en}   plain text from the SGML test files
    prepared.json  written last: the cleaning settings, counts, and size + sha256 of every file above
Checksums: the two test archives against the md5 sacreBLEU publishes; the training archives (no published
checksum) against the size + sha256 recorded in archives/checksums.json at their first download.

Cleaning (in the spirit of Moses' clean-corpus-n.perl, on whitespace-separated words): whitespace runs
collapse to one space and ends are stripped; a pair is dropped if a side is empty, has more than
data.wmt14.max_words words, or has more than data.wmt14.max_ratio times the words of the other side.
"""
import json
import logging
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from transformer.atomic import atomic_open, write_text_atomic
from transformer.data.corpus import count_pairs, iter_lines, iter_pairs
from transformer.data.download import DownloadError, data_root, fetch, make_dirs, remove_empty, sha256_file

log = logging.getLogger(__name__)
LANGS = ("de", "en")
SPLITS = ("train", "newstest2013", "newstest2014")


@dataclass(frozen=True)
class Archive:
    path: str  # below data.url
    members: Tuple[str, ...]  # "{lang}" is replaced by de and en
    md5: Optional[str] = None  # published (sacreBLEU's dataset table)


ARCHIVES = {
    "europarl": Archive("wmt13/training-parallel-europarl-v7.tgz", ("training/europarl-v7.de-en.{lang}",)),
    "commoncrawl": Archive("wmt13/training-parallel-commoncrawl.tgz", ("commoncrawl.de-en.{lang}",)),
    "news-commentary": Archive("wmt14/training-parallel-nc-v9.tgz", ("training/news-commentary-v9.de-en.{lang}",)),
    "newstest2013": Archive("wmt13/test.tgz", ("test/newstest2013-src.{lang}.sgm",),
                            md5="48eca5d02f637af44e85186847141f67"),
    "newstest2014": Archive("wmt14/test-full.tgz", ("test-full/newstest2014-deen-src.{lang}.sgm",
                                                    "test-full/newstest2014-deen-ref.{lang}.sgm"),
                            md5="a8cd784e006feb32ac6f3d9ec7eb389a"),
}
TRAIN = ("europarl", "commoncrawl", "news-commentary")
PREPARED = "prepared.json"
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")
_SPACE = re.compile(r"\s+")


def _members(archive: Archive):
    return [m.format(lang=lang) for m in archive.members for lang in LANGS]


def _raw(folder: Path, member: str) -> Path:
    return folder / "raw" / Path(member).name


def _download(folder: Path, d, name: str, progress: bool) -> Path:
    """The archive `name`, downloaded (or resumed) and checked; checksums of unpublished ones are recorded."""
    archive = ARCHIVES[name]
    path = folder / "archives" / Path(archive.path).name
    record_file = folder / "archives" / "checksums.json"
    records = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if not path.exists():
        url = f"{d.url.rstrip('/')}/{archive.path}"
        log.info("downloading %s to %s", url, path)
        digest = fetch(url, path, md5=archive.md5, retries=d.download_retries, timeout_s=d.download_timeout_s,
                       deadline_s=d.download_deadline_s, progress=progress)
        if archive.md5 is None and path.name not in records:
            records[path.name] = {"bytes": path.stat().st_size, "sha256": digest}
            write_text_atomic(record_file, json.dumps(records, indent=1) + "\n")
    elif archive.md5 is None and path.name in records:
        want, size = records[path.name], path.stat().st_size
        if size != want["bytes"] or sha256_file(path) != want["sha256"]:
            raise ValueError(f"{path}: differs from its first download ({record_file}): delete it to download "
                             "it again")
    elif archive.md5 is not None:
        from hashlib import md5
        h = md5()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != archive.md5:
            raise ValueError(f"{path}: md5 is {h.hexdigest()}, expected {archive.md5}: delete it to download it again")
    return path


def _extract(folder: Path, archive_path: Path, members) -> None:
    """Streams through the archive once, copying the wanted members to raw/ (atomically)."""
    wanted = {m: _raw(folder, m) for m in members if not _raw(folder, m).exists()}
    if not wanted:
        return
    (folder / "raw").mkdir(parents=True, exist_ok=True)
    log.info("extracting %s", ", ".join(sorted(wanted)))
    try:
        with tarfile.open(archive_path, "r|gz") as tar:
            for info in tar:
                if info.name.lstrip("./") in wanted and info.isfile():
                    with tar.extractfile(info) as src, atomic_open(wanted.pop(info.name.lstrip("./")), "wb") as out:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            out.write(chunk)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ValueError(f"{archive_path}: cannot read the archive ({e}): delete it to download it again") from None
    if wanted:
        raise ValueError(f"{archive_path}: has no member {sorted(wanted)[0]} (not the expected archive?)")


def _sgm_to_text(sgm: Path, out: Path) -> int:
    """The <seg> texts of a WMT SGML file, one a line, whitespace-normalised as sacreBLEU does."""
    n = 0
    with atomic_open(out, "w", encoding="utf-8") as f:
        for lines in iter_lines(sgm):
            for line in lines:
                m = _SEG.search(line)
                if m:
                    f.write(_SPACE.sub(" ", m.group(1).strip()) + "\n")
                    n += 1
    return n


def clean_pair(src: str, tgt: str, max_words: int, max_ratio: float) -> Optional[Tuple[str, str]]:
    """The pair with whitespace normalised, or None if it is dropped (see the module docstring)."""
    src, tgt = _SPACE.sub(" ", src).strip(), _SPACE.sub(" ", tgt).strip()
    ns, nt = src.count(" ") + 1, tgt.count(" ") + 1
    if not src or not tgt or ns > max_words or nt > max_words or ns > max_ratio * nt or nt > max_ratio * ns:
        return None
    return src, tgt


def _clean_train(folder: Path, d, progress: bool) -> dict:
    from tqdm import tqdm
    counts, c = {}, d.wmt14
    with atomic_open(folder / "train.de", "w", encoding="utf-8") as out_de, \
            atomic_open(folder / "train.en", "w", encoding="utf-8") as out_en:
        for name in TRAIN:
            member = ARCHIVES[name].members[0]
            de, en = (_raw(folder, member.format(lang=lang)) for lang in LANGS)
            n, kept = count_pairs(de, en), 0
            with tqdm(total=n, unit=" pairs", unit_scale=True, desc=f"cleaning {name}", disable=not progress,
                      leave=False, mininterval=1.0) as bar:
                for src, tgt in iter_pairs(de, en, 100_000):
                    cleaned = (clean_pair(s, t, c.max_words, c.max_ratio) for s, t in zip(src, tgt, strict=False))
                    pairs = [p for p in cleaned if p]
                    out_de.write("".join(p[0] + "\n" for p in pairs))
                    out_en.write("".join(p[1] + "\n" for p in pairs))
                    kept += len(pairs)
                    bar.update(len(src))
            counts[name] = {"pairs": n, "kept": kept}
            log.info("%s: kept %d of %d pairs", name, kept, n)
    return counts


def _outputs() -> list:
    return ([f"train.{lang}" for lang in LANGS] + [f"newstest2013.{lang}" for lang in LANGS]
            + [f"newstest2014-{kind}.{lang}" for kind in ("src", "ref") for lang in LANGS])


def prepare_wmt14(d, progress: bool = True, download: bool = True, root_key: str = "data.root") -> Path:
    """ROOT/wmt14 with every file ready (see the module docstring); only checks sizes once it is. With
    `download=False` (a dataset folder a command only reads) a folder not ready is an error naming `root_key`,
    and nothing in it is changed."""
    folder = data_root(d.root) / "wmt14"
    settings = {"max_words": d.wmt14.max_words, "max_ratio": d.wmt14.max_ratio}
    done = folder / PREPARED
    prepared = json.loads(done.read_text()) if done.is_file() else None
    if prepared is not None:
        intact = all((folder / n).is_file() and (folder / n).stat().st_size == f["bytes"]
                     for n, f in prepared["files"].items())
        if prepared.get("clean") == settings and intact:
            return folder
    if not download:
        raise FileNotFoundError(f"{folder} holds no prepared WMT14 ({PREPARED}) for these settings, and a dataset "
                                f"folder is only read here, never written to: point {root_key} at a folder holding it")
    if prepared is not None:
        done.unlink()  # other cleaning settings, or files changed: prepare again from the raw files
        for name in ("train.de", "train.en"):
            (folder / name).unlink(missing_ok=True)
    made = make_dirs(folder)
    try:
        for name, archive in ARCHIVES.items():
            members = _members(archive)
            if any(not _raw(folder, m).exists() for m in members):
                _extract(folder, _download(folder, d, name, progress), members)
    except DownloadError:
        remove_empty(made)  # a first download that failed leaves no empty wmt14/ behind
        raise
    counts = _clean_train(folder, d, progress)
    for lang in LANGS:
        counts[f"newstest2013.{lang}"] = _sgm_to_text(_raw(folder, f"test/newstest2013-src.{lang}.sgm"),
                                                      folder / f"newstest2013.{lang}")
        for kind in ("src", "ref"):
            counts[f"newstest2014-{kind}.{lang}"] = _sgm_to_text(
                _raw(folder, f"test-full/newstest2014-deen-{kind}.{lang}.sgm"), folder / f"newstest2014-{kind}.{lang}")
    files = {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in _outputs()}
    write_text_atomic(done, json.dumps({"clean": settings, "counts": counts, "files": files}, indent=1) + "\n")
    return folder


def wmt14_files(d, split: str, progress: bool = True, download: bool = True,
                root_key: str = "data.root") -> Tuple[Path, Path]:
    """(source file, target file) of `split` (train, newstest2013, newstest2014) in data.src_lang -> tgt_lang."""
    if {d.src_lang, d.tgt_lang} != set(LANGS):
        raise ValueError(f"data.src_lang={d.src_lang} data.tgt_lang={d.tgt_lang}: WMT14 here is en-de, either "
                         "direction")
    if split not in SPLITS:
        raise ValueError(f"data=wmt14 has no split {split!r} (splits: {', '.join(SPLITS)})")
    folder = prepare_wmt14(d, progress, download, root_key)
    if split == "newstest2014":  # the source side from the source-language file, the reference from the other
        return folder / f"newstest2014-src.{d.src_lang}", folder / f"newstest2014-ref.{d.tgt_lang}"
    return folder / f"{split}.{d.src_lang}", folder / f"{split}.{d.tgt_lang}"


def recorded_digests(src: Path, tgt: Path) -> List[str]:
    """sha256 of prepared files, from prepared.json (hashing 1 GB of text every run would cost seconds)."""
    files = json.loads((src.parent / PREPARED).read_text())["files"]
    return [files[src.name]["sha256"], files[tgt.name]["sha256"]]
