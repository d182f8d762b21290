"""The one text reader (transformer/data/textfile.py): its rules on files, pipes, gzip and /dev/null, and the
same odd file read alike by transformer-translate, transformer-evaluate and training."""
import gzip
import io
import json

import pytest
import sacrebleu

from tests.helpers.data import FakeEnv, small_files_cfg, write_lines
from tests.helpers.models import copy_checkpoint, one_thread  # noqa: F401
from tests.helpers.textfiles import BAD, BAD_BYTE, ODD, ODD_LINES, fifo
from transformer import decoding
from transformer.cli import evaluate, translate
from transformer.data.textfile import check_readable, check_rereadable, iter_lines, kind, read_lines
from transformer.data.translation import build_translation_data
from transformer.training.components.checkpoint import atomic_save


def test_the_rules_on_a_file_a_stream_a_pipe_and_gzip(tmp_path):
    (tmp_path / "odd.txt").write_bytes(ODD)
    (tmp_path / "odd.txt.gz").write_bytes(gzip.compress(ODD))
    assert read_lines(tmp_path / "odd.txt") == ODD_LINES
    assert read_lines(tmp_path / "odd.txt.gz") == ODD_LINES
    assert read_lines(io.BufferedReader(io.BytesIO(gzip.compress(ODD))), "<stdin>") == ODD_LINES  # by its magic
    with fifo(tmp_path / "pipe", ODD) as pipe:
        assert read_lines(pipe) == ODD_LINES
    with fifo(tmp_path / "gzpipe", gzip.compress(ODD)) as pipe:  # `<(cat odd.txt.gz)`: no .gz in the name
        assert read_lines(pipe) == ODD_LINES


def test_a_byte_order_mark_is_dropped_only_at_the_start(tmp_path):
    path = write_lines(tmp_path / "a.txt", ["\ufeffone", "two \ufeff", "\ufeffthree"])
    assert read_lines(path) == ["one", "two \ufeff", "\ufeffthree"]


def test_invalid_utf8_in_a_pipe_names_the_line_and_byte(tmp_path):
    with fifo(tmp_path / "pipe", BAD) as pipe, pytest.raises(ValueError) as e:
        read_lines(pipe)
    assert str(e.value) == f"{pipe}, line 5: invalid UTF-8 (invalid start byte at byte {BAD_BYTE})"


def test_dev_null_is_empty_which_only_some_readers_accept():
    assert [ln for chunk in iter_lines("/dev/null", empty_ok=True) for ln in chunk] == []
    with pytest.raises(ValueError, match="^/dev/null: file is empty$"):
        read_lines("/dev/null")


def test_what_a_path_is_and_the_errors_for_paths_that_cannot_be_read(tmp_path):
    (tmp_path / "f.txt").write_text("x\n")
    with fifo(tmp_path / "pipe", b"") as pipe:
        assert [kind(p) for p in (tmp_path / "f.txt", tmp_path, pipe, "/dev/null", tmp_path / "nope")] == \
            ["file", "folder", "pipe", "character device", "missing"]
        for readable in (tmp_path / "f.txt", pipe, "/dev/null"):
            check_readable(readable, "--src X")
        with pytest.raises(ValueError, match=r"^KEY: .*pipe is a pipe, which can be read only once, and WHY: write it"):
            check_rereadable(pipe, "KEY", "WHY")
    with pytest.raises(ValueError, match="^--src X: no such file$"):
        check_readable(tmp_path / "nope", "--src X")
    with pytest.raises(ValueError, match="^--src X: is a folder, not a file$"):
        check_readable(tmp_path, "--src X")
    with pytest.raises(ValueError, match="^KEY: /dev/null is a character device, which can be read only once"):
        check_rereadable("/dev/null", "KEY", "WHY")
    check_rereadable(tmp_path / "f.txt", "KEY", "WHY")


# ---- the same file through every command --------------------------------------------------------------------
@pytest.fixture
def model_sees(monkeypatch):
    """The source id lists each call hands to the model, in order."""
    seen = []
    real = decoding.translate_ids

    def spy(model, tokenizer, ids, *args, **kw):
        seen.append([list(x) for x in ids])
        return real(model, tokenizer, ids, *args, **kw)

    monkeypatch.setattr(decoding, "translate_ids", spy)
    return seen


def test_translate_evaluate_and_training_read_an_odd_file_alike(tmp_path, model_sees, capsys):
    ckpt = tmp_path / "model.pt"
    atomic_save(copy_checkpoint(), ckpt)
    src, ref = tmp_path / "odd.de", tmp_path / "odd.en"
    src.write_bytes(ODD)
    ref.write_bytes(ODD.replace(b"7 8", b"7 8 9"))  # references as odd as the sources, one sentence different
    assert translate.main([str(ckpt), "--input", str(src), "--output", str(tmp_path / "hyp"), "--beam", "2"]) == 0
    assert evaluate.main([str(ckpt), "--src", str(src), "--ref", str(ref), "--beam", "2",
                          "--out-dir", str(tmp_path / "eval")]) == 0
    content = [[int(t) for t in ln.split()] for ln in ODD_LINES if ln.strip()]  # blank lines never reach it
    assert model_sees == [content, content]
    translated = (tmp_path / "hyp").read_text(encoding="utf-8").split("\n")
    evaluated = (tmp_path / "eval" / "odd.de.hyp").read_text(encoding="utf-8").split("\n")
    assert translated == evaluated and len(translated) == len(ODD_LINES) + 1
    assert translated[2] == translated[3] == ""  # blank in, blank out: line k still answers line k
    scores = json.loads((tmp_path / "eval" / "odd.de.json").read_text())
    refs = read_lines(ref)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(translated[:-1], [refs]).score, abs=1e-9)
    assert 0 < scores["bleu"] < 100

    cfg = small_files_cfg(tmp_path / "train")  # training reads the same file as its validation sources
    (tmp_path / "train" / "corpus" / "val.de").write_bytes(ODD)
    write_lines(tmp_path / "train" / "corpus" / "val.en", ODD_LINES)
    dm = build_translation_data(cfg, FakeEnv(), None)
    assert dm.valid_srcs == [ln for ln in ODD_LINES if ln.strip()]


def test_an_invalid_byte_is_the_same_error_everywhere(tmp_path, capsys):
    ckpt = tmp_path / "model.pt"
    atomic_save(copy_checkpoint(), ckpt)
    src = tmp_path / "bad.de"
    src.write_bytes(BAD)
    (tmp_path / "ref.en").write_bytes(ODD)
    want = f"{src}, line 5: invalid UTF-8 (invalid start byte at byte {BAD_BYTE})"
    assert translate.main([str(ckpt), "--input", str(src), "--output", str(tmp_path / "hyp")]) == 2
    assert capsys.readouterr().err == f"transformer-translate: error: {want}\n"
    assert evaluate.main([str(ckpt), "--src", str(src), "--ref", str(tmp_path / "ref.en"),
                          "--out-dir", str(tmp_path / "eval")]) == 2
    assert capsys.readouterr().err == f"transformer-evaluate: error: {want}\n"
    cfg = small_files_cfg(tmp_path / "train")
    (tmp_path / "train" / "corpus" / "val.de").write_bytes(BAD)
    (tmp_path / "train" / "corpus" / "val.en").write_bytes(ODD)
    with pytest.raises(ValueError) as e:
        build_translation_data(cfg, FakeEnv(), None)
    assert str(e.value) == want.replace(str(src), str(tmp_path / "train" / "corpus" / "val.de"))
    assert not (tmp_path / "hyp").exists() and not (tmp_path / "eval").exists()
