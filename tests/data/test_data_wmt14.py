"""data=wmt14: download (resumed after an interruption) -> extraction -> cleaning -> preprocessing, against a
loopback HTTP server serving small archives with the real statmt.org layout. No test touches the network."""
import hashlib
import io
import json
import socket
import tarfile
import urllib.request

import pytest

from tests.helpers.data import data_cfg, serve_ranges
from transformer.data import wmt14
from transformer.data.download import DownloadError
from transformer.data.preprocess import Options
from transformer.data.store import Preprocessed
from transformer.data.translation import load_split, preprocess_corpus

N = {"europarl": 30, "commoncrawl": 20, "news-commentary": 10}


def _pairs(name, n):
    de = [f"Das  ist der Satz {i} aus {name} ." for i in range(n)]
    en = [f"This is sentence {i} from {name} ." for i in range(n)]
    de[3], en[3] = "", "An orphan."  # empty side: dropped
    de[5] = "Zu " + "viele Wörter " * 15  # 31 words > max_words=20: dropped
    en[7] = "Far too many words on this side for the other one to match it ."  # 14 vs 8 words > ratio 1.5
    return de, en


def _sgm(setid, segs):
    body = "".join(f'<seg id="{i + 1}"> {s} </seg>\n' for i, s in enumerate(segs))
    return f'<srcset setid="{setid}" srclang="any">\n<doc sysid="ref" docid="1-x" genre="news" origlang="en">\n' \
           f"<p>\n{body}</p>\n</doc>\n</srcset>\n"


def _tgz(path, members):
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.md5(path.read_bytes()).hexdigest()


def mirror(root):
    """statmt.org's layout: three training archives, wmt13/test.tgz and wmt14/test-full.tgz, with decoys."""
    lines = {name: _pairs(name, n) for name, n in N.items()}
    text = lambda xs: "".join(x + "\n" for x in xs)  # noqa: E731
    _tgz(root / "wmt13/training-parallel-europarl-v7.tgz", {
        "training/europarl-v7.de-en.de": text(lines["europarl"][0]),
        "training/europarl-v7.de-en.en": text(lines["europarl"][1]), "training/europarl-v7.fr-en.fr": "Non.\n"})
    _tgz(root / "wmt13/training-parallel-commoncrawl.tgz", {
        "commoncrawl.de-en.annotation": "x\n", "commoncrawl.de-en.de": text(lines["commoncrawl"][0]),
        "commoncrawl.de-en.en": text(lines["commoncrawl"][1])})
    _tgz(root / "wmt14/training-parallel-nc-v9.tgz", {
        "training/news-commentary-v9.de-en.de": text(lines["news-commentary"][0]),
        "training/news-commentary-v9.de-en.en": text(lines["news-commentary"][1])})
    md5 = {"newstest2013": _tgz(root / "wmt13/test.tgz", {
        "test/newstest2013-src.de.sgm": _sgm("newstest2013", [f"Test  {i} ." for i in range(5)]),
        "test/newstest2013-src.en.sgm": _sgm("newstest2013", [f"Test {i} ." for i in range(5)]),
        "test/newstest2013-src.fr.sgm": _sgm("newstest2013", ["Non."] * 5)})}
    md5["newstest2014"] = _tgz(root / "wmt14/test-full.tgz", {
        f"test-full/newstest2014-deen-{kind}.{lang}.sgm": _sgm("newstest2014", [f"{kind} {lang} {i}" for i in range(4)])
        for kind in ("src", "ref") for lang in ("de", "en")})
    return md5


@pytest.fixture
def server_root(tmp_path, monkeypatch):
    md5 = mirror(tmp_path / "server")
    for name, digest in md5.items():  # the synthetic test archives stand in for the published ones
        monkeypatch.setitem(wmt14.ARCHIVES, name, wmt14.ARCHIVES[name].__class__(
            wmt14.ARCHIVES[name].path, wmt14.ARCHIVES[name].members, digest))
    return tmp_path / "server"


def cfg_for(tmp_path, url, **data):
    data.setdefault("download_retries", 1)
    cfg = data_cfg(tmp_path, "wmt14", "bpe", url=url, src_lang="en", tgt_lang="de", train_split="train",
                   valid_split="newstest2013", tok={"vocab_size": 120, "min_freq": 1}, **data)
    cfg.data.wmt14.max_words = 20
    return cfg


EUROPARL = "/wmt13/training-parallel-europarl-v7.tgz"


def test_interrupted_download_resumes_then_the_chain_runs(tmp_path, server_root, monkeypatch):
    archives = tmp_path / "root" / "wmt14" / "archives"
    with serve_ranges(server_root, cut={EUROPARL: 100}) as (url, requests):
        cfg = cfg_for(tmp_path, url)
        with pytest.raises(DownloadError,
                           match=r"the 100 bytes received are kept in .*\.part and the next run resumes"):
            preprocess_corpus(cfg, tmp_path / "bin", Options(progress=False))
        assert (archives / ".training-parallel-europarl-v7.tgz.part").stat().st_size == 100
        assert not (tmp_path / "bin").exists()
        folder = preprocess_corpus(cfg, tmp_path / "bin", Options(progress=False))
    assert requests[:2] == [(EUROPARL, None), (EUROPARL, "bytes=100-")]  # the second run asked for the rest
    assert (archives / "training-parallel-europarl-v7.tgz").read_bytes() == (server_root / EUROPARL[1:]).read_bytes()
    assert sorted(p.name for p in archives.iterdir()) == ["checksums.json", "test-full.tgz", "test.tgz",
                                                          "training-parallel-commoncrawl.tgz",
                                                          "training-parallel-europarl-v7.tgz",
                                                          "training-parallel-nc-v9.tgz"]
    recorded = json.loads((archives / "checksums.json").read_text())  # no published checksum: recorded
    assert sorted(recorded) == ["training-parallel-commoncrawl.tgz", "training-parallel-europarl-v7.tgz",
                                "training-parallel-nc-v9.tgz"]

    m = Preprocessed(folder).manifest
    prepared = json.loads((tmp_path / "root" / "wmt14" / "prepared.json").read_text())
    assert {k: v["kept"] for k, v in prepared["counts"].items() if k in N} == {k: n - 3 for k, n in N.items()}
    assert m["splits"]["train"]["lines"] == sum(N.values()) - 9
    assert m["splits"]["valid"]["pairs"] == 5 and (m["src_lang"], m["tgt_lang"]) == ("en", "de")
    train_en = (tmp_path / "root" / "wmt14" / "train.en").read_text().splitlines()
    assert train_en[0] == "This is sentence 0 from europarl ." and train_en[-1].endswith("news-commentary .")
    assert (tmp_path / "root" / "wmt14" / "train.de").read_text().startswith("Das ist der Satz 0")  # spaces
    assert Preprocessed(folder).valid_text() == ([f"Test {i} ." for i in range(5)], [f"Test {i} ." for i in range(5)])

    # Prepared once: the test split (either direction) and a second run need no network.
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("network access attempted"))
    assert load_split(cfg, "newstest2014") == ([f"src en {i}" for i in range(4)], [f"ref de {i}" for i in range(4)])
    cfg.data.src_lang, cfg.data.tgt_lang = "de", "en"
    assert load_split(cfg, "newstest2014") == ([f"src de {i}" for i in range(4)], [f"ref en {i}" for i in range(4)])
    with pytest.raises(ValueError, match="data=wmt14 has no split 'newstest2099'"):
        load_split(cfg, "newstest2099")


def test_resume_within_one_run_and_recorded_checksums_guard_the_archives(tmp_path, server_root):
    with serve_ranges(server_root, cut={EUROPARL: 50}) as (url, requests):
        cfg = cfg_for(tmp_path, url, download_retries=2, download_timeout_s=5)
        wmt14.prepare_wmt14(cfg.data, progress=False)
    assert [r for r in requests if r[0] == EUROPARL] == [(EUROPARL, None), (EUROPARL, "bytes=50-")]
    folder = tmp_path / "root" / "wmt14"
    # An archive that changes after its first download is refused when it is needed again.
    archive = folder / "archives" / "training-parallel-europarl-v7.tgz"
    data = archive.read_bytes()
    archive.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    for p in (folder / "raw").glob("europarl*"):
        p.unlink()
    (folder / "prepared.json").unlink()
    with pytest.raises(ValueError, match=r"training-parallel-europarl-v7\.tgz: differs from its first download"):
        wmt14.prepare_wmt14(cfg.data, progress=False)


def test_published_checksum_mismatch_keeps_nothing(tmp_path, server_root, monkeypatch):
    wrong = wmt14.Archive("wmt14/test-full.tgz", wmt14.ARCHIVES["newstest2014"].members, "0" * 32)
    monkeypatch.setitem(wmt14.ARCHIVES, "newstest2014", wrong)
    with serve_ranges(server_root) as (url, _):
        with pytest.raises(DownloadError, match=r"test-full\.tgz: md5 is .*, expected 0{32}; nothing was written"):
            wmt14.prepare_wmt14(cfg_for(tmp_path, url).data, progress=False)
    leftovers = [p.name for p in (tmp_path / "root" / "wmt14" / "archives").iterdir()]
    assert "test-full.tgz" not in leftovers and ".test-full.tgz.part" not in leftovers
    assert not (tmp_path / "root" / "wmt14" / "prepared.json").exists()


def test_a_failed_first_download_leaves_no_empty_folders(tmp_path):
    with socket.socket() as s:  # a port nobody listens on once this socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = cfg_for(tmp_path, f"http://127.0.0.1:{port}", download_timeout_s=5)
    with pytest.raises(DownloadError, match="could not download"):
        wmt14.prepare_wmt14(cfg.data, progress=False)
    assert not (tmp_path / "root").exists()  # neither root/, nor wmt14/, nor wmt14/archives/


def test_a_read_only_data_root_is_never_prepared_or_changed(tmp_path, server_root, monkeypatch):
    """transformer-evaluate's rule for WMT14: a folder not prepared (or prepared with other cleaning settings)
    is an error naming the flag, with no network call and nothing in the folder changed."""
    with serve_ranges(server_root) as (url, _):
        cfg = cfg_for(tmp_path, url)
        with pytest.raises(FileNotFoundError, match=r"holds no prepared WMT14.*point --data-root at"):
            load_split(cfg, "newstest2014", download=False, root_key="--data-root")
        assert not (tmp_path / "root").exists()
        wmt14.prepare_wmt14(cfg.data, progress=False)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("network access attempted"))
    folder = tmp_path / "root" / "wmt14"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert load_split(cfg, "newstest2014", download=False)[0] == [f"src en {i}" for i in range(4)]
    cfg.data.wmt14.max_words = 19  # other cleaning settings: a writable root would prepare again
    with pytest.raises(FileNotFoundError, match="for these settings"):
        load_split(cfg, "newstest2014", download=False, root_key="--data-root")
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("src,tgt,kept", [
    ("a  b\tc ", " x y z", ("a b c", "x y z")), ("", "x", None), ("a b c d", "x y", None),
    ("a b c", "x y", ("a b c", "x y")),
    ("w " * 21, "w " * 20, None)])
def test_cleaning_rules(src, tgt, kept):
    assert wmt14.clean_pair(src, tgt, max_words=20, max_ratio=1.5) == kept


def test_languages_must_be_english_and_german(tmp_path):
    cfg = cfg_for(tmp_path, "http://127.0.0.1:9")
    cfg.data.tgt_lang = "fr"
    with pytest.raises(ValueError, match="WMT14 here is en-de"):
        load_split(cfg, "train")
