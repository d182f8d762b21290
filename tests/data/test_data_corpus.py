"""data=files: reading parallel text, the errors for bad corpora (pipes and folders too), bad-pair filtering,
direction."""
import gzip

import pytest

from tests.helpers.data import TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, FakeEnv, small_files_cfg, write_corpus, write_lines
from tests.helpers.textfiles import fifo
from transformer.data.batch import BOS, EOS
from transformer.data.corpus import iter_pairs, read_lines, read_parallel, resolve
from transformer.data.translation import build_translation_data, filter_pairs, load_split


def test_read_lines_plain_and_gzip(tmp_path):
    lines = ["Ein Hund.", "", "Zwei  Katzen. "]
    assert read_lines(write_lines(tmp_path / "a.de", lines)) == lines
    assert read_lines(write_lines(tmp_path / "a.de.gz", lines)) == lines


def test_only_newline_splits_lines(tmp_path):
    p = tmp_path / "a.en"
    p.write_bytes("\ufeffone\u2028still one\x85\r\ntwo\x1cstill two\nthree".encode())
    assert read_lines(p) == ["one\u2028still one\x85", "two\x1cstill two", "three"]


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"corpus file not found: .*train\.de \(nor train\.de\.gz\)"):
        resolve(str(tmp_path / "train"), "de")


def test_a_training_corpus_must_be_a_file_not_a_pipe_or_a_folder(tmp_path):
    """Training reads its corpus several times: a pipe (here one that could even be read again) is refused by
    name; a test split, read once, may be one (tests/cli/test_evaluate.py)."""
    cfg = small_files_cfg(tmp_path)
    prefix = cfg.data.files.train
    train_de = tmp_path / "corpus" / "train.de"
    data = train_de.read_bytes()
    train_de.unlink()
    with fifo(train_de, data, again=True):
        with pytest.raises(ValueError, match=rf"^data\.files\.train={prefix}: {train_de} is a pipe, which can be "
                                             r"read only once, and this corpus is read several times \(its sha256"):
            build_translation_data(cfg, FakeEnv(), None)
        assert resolve(prefix, "de", read_once=True) == train_de
    train_de.unlink()
    train_de.mkdir()
    with pytest.raises(ValueError, match=rf"^data\.files\.train={prefix}: {train_de} is a folder, not a file$"):
        build_translation_data(cfg, FakeEnv(), None)


def test_plain_and_gz_both_present_is_ambiguous(tmp_path):
    write_corpus(tmp_path, "train", ["a"], ["b"])
    write_corpus(tmp_path, "train", ["a"], ["b"], gz=True)
    with pytest.raises(ValueError, match="both .*train.de and .*train.de.gz exist"):
        resolve(str(tmp_path / "train"), "de")


def test_gz_prefix_is_found(tmp_path):
    prefix = write_corpus(tmp_path, "train", ["a"], ["b"], gz=True)
    assert resolve(prefix, "en") == tmp_path / "train.en.gz"


def test_mismatched_line_counts(tmp_path):
    write_lines(tmp_path / "t.de", ["a", "b", "c"])
    write_lines(tmp_path / "t.en", ["a", "b"])
    with pytest.raises(ValueError, match=r"t\.de has 3 lines but .*t\.en has 2: line 3 has no partner"):
        read_parallel(tmp_path / "t.de", tmp_path / "t.en")


def test_streamed_pairs_stop_where_a_file_changed_after_its_count(tmp_path):
    """iter_pairs streams chunks without counting first (count_pairs did, earlier): a file shortened since then
    ends in the same error, at the chunk where the two sides part, not in silently dropped pairs."""
    write_lines(tmp_path / "t.de", ["a", "b", "c", "d", "e"])
    write_lines(tmp_path / "t.en", ["a", "b", "c"])
    pairs = iter_pairs(tmp_path / "t.de", tmp_path / "t.en", chunk=2)
    assert next(pairs) == (["a", "b"], ["a", "b"])
    with pytest.raises(ValueError, match=r"t\.de has 5 lines but .*t\.en has 3: line 4 has no partner"):
        next(pairs)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file(tmp_path, content):
    (tmp_path / "t.de").write_bytes(content)
    with pytest.raises(ValueError, match=r"t\.de: file is empty"):
        read_lines(tmp_path / "t.de")


@pytest.mark.parametrize("gz", [False, True])
def test_invalid_utf8_names_file_and_line(tmp_path, gz):
    data = b"gut\nauch gut\n" + b"schlecht \xff\xfe\n" + b"ok\n"
    path = tmp_path / ("t.de.gz" if gz else "t.de")
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(ValueError, match=r"t\.de(\.gz)?, line 3: invalid UTF-8"):
        read_lines(path)


def test_broken_gzip(tmp_path):
    (tmp_path / "t.de.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"t\.de\.gz: cannot read"):
        read_lines(tmp_path / "t.de.gz")


def test_filter_pairs_skip_counts_and_error_names_line(tmp_path):
    src = [[4, 5], [], [4] * 9, [4]]
    tgt = [[4], [4], [4], [4] * 3]
    keep, skipped = filter_pairs(src, tgt, 8, "skip", tmp_path / "x.de", tmp_path / "x.en")
    assert keep == [0, 3] and skipped == {"empty": 1, "too_long": 1}
    with pytest.raises(ValueError, match=r"x\.de, line 2: empty sentence"):
        filter_pairs(src, tgt, 8, "error", tmp_path / "x.de", tmp_path / "x.en")
    with pytest.raises(ValueError, match=r"x\.de, line 3: 9 tokens, more than data.max_len=8"):
        filter_pairs(src[:1] * 2 + src[2:], tgt, 8, "error", tmp_path / "x.de", tmp_path / "x.en")


def test_files_end_to_end(tmp_path):
    cfg = small_files_cfg(tmp_path)
    dm = build_translation_data(cfg, FakeEnv(), tmp_path / "run")
    assert (len(dm.train), len(dm.valid)) == (len(TRAIN_DE), len(VAL_DE))
    assert dm.task == "translation" and not dm.shared_vocab
    assert dm.valid_srcs == VAL_DE and dm.valid_refs == VAL_EN
    assert dm.tokenizer.src_lang == "de" and "Hund" in dm.tokenizer.src_vocab.stoi
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["tokenizer.json", "vocab.de.txt", "vocab.en.txt"]
    seen = []
    for batch in dm.train_loader(0):
        assert (batch.tgt_in[:, 0] == BOS).all()
        for b, i in enumerate(batch.ids.tolist()):
            seen.append(i)
            n = len(dm.train.tgt[i])
            assert dm.tokenizer.decode_tgt(batch.tgt_out[b].tolist()) == TRAIN_EN[i]
            assert batch.tgt_out[b, n] == EOS
    assert sorted(seen) == list(range(len(TRAIN_DE)))
    for batch in dm.valid_loader():
        for b, i in enumerate(batch.ids.tolist()):  # valid example i <-> valid_refs[i]
            assert dm.tokenizer.decode_tgt(batch.tgt_out[b].tolist()) == dm.valid_refs[i].replace("women", "<unk>")


def test_files_reverse_direction(tmp_path):
    cfg = small_files_cfg(tmp_path, src_lang="en", tgt_lang="de")
    dm = build_translation_data(cfg, FakeEnv(), None)
    assert dm.valid_srcs == VAL_EN and dm.valid_refs == VAL_DE
    assert "Hund" in dm.tokenizer.tgt_vocab.stoi and "dog" in dm.tokenizer.src_vocab.stoi


def test_files_bad_pairs(tmp_path):
    src, tgt = TRAIN_DE + ["", "Ein sehr sehr langer Satz mit vielen vielen Wörtern ."], TRAIN_EN + ["A dog.", "Short."]
    cfg = small_files_cfg(tmp_path, max_len=9)
    cfg.data.files.train = write_corpus(tmp_path / "bad", "train", src, tgt)
    dm = build_translation_data(cfg, FakeEnv(), None)
    assert len(dm.train) == len(TRAIN_DE)  # the empty and the 10-token pair are skipped
    cfg.data.bad_pairs = "error"
    with pytest.raises(ValueError, match=rf"bad/train\.de, line {len(TRAIN_DE) + 1}: empty sentence"):
        build_translation_data(cfg, FakeEnv(), None)


def test_files_errors_surface_from_build(tmp_path):
    cfg = small_files_cfg(tmp_path)
    write_lines(tmp_path / "corpus" / "val.en", VAL_EN + ["extra"])
    with pytest.raises(ValueError, match=r"val\.de has 2 lines but .*val\.en has 3"):
        build_translation_data(cfg, FakeEnv(), None)
    del cfg.data.files["val"]
    with pytest.raises(ValueError, match="data.files.val is not set"):
        build_translation_data(cfg, FakeEnv(), None)


def test_load_split_gives_raw_text(tmp_path):
    cfg = small_files_cfg(tmp_path)
    cfg.data.files["test"] = write_corpus(tmp_path / "corpus", "test", ["Ein Hund.", ""], ["A dog.", ""], gz=True)
    assert load_split(cfg, "test") == (["Ein Hund.", ""], ["A dog.", ""])
    with pytest.raises(ValueError, match="data.files.nope is not set"):
        load_split(cfg, "nope")
