"""`--backend ctranslate2` of transformer-translate and transformer-evaluate (transformer/interop/backend.py): the
export cached beside the checkpoint, made once and remade for a newer checkpoint, greedy outputs equal to the
torch decoder's, and the one-line errors. In this process, on the export tests' small memorised model."""
import errno
import json
import os
import sys

import pytest

from tests.helpers.export import PAIRS, SRC, checkpoint, tokenizer, trained_model
from tests.helpers.models import one_thread  # noqa: F401  (autouse)
from transformer.cli import evaluate as evaluate_cli
from transformer.cli import translate as translate_cli
from transformer.training.components.checkpoint import atomic_save


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint file of the memorised model and the sources, in tmp_path."""
    atomic_save(checkpoint(trained_model("all", True), tokenizer(True)), tmp_path / "m.pt")
    (tmp_path / "in.txt").write_text("\n".join(SRC + [""] + SRC[:3]) + "\n", encoding="utf-8")
    return tmp_path / "m.pt"


def translate(ckpt, capsys, *flags):
    code = translate_cli.main([str(ckpt), "--input", str(ckpt.parent / "in.txt"), *flags])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def exports(monkeypatch):
    """Counts the CTranslate2 exports made."""
    from transformer.interop import ct2

    calls = []
    real = ct2.export_ct2

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(ct2, "export_ct2", counted)
    return calls


@pytest.mark.parametrize("beam", [1, 5])
def test_ctranslate2_outputs_equal_torch(ckpt, capsys, beam):
    pytest.importorskip("ctranslate2")
    code, torch_out, _ = translate(ckpt, capsys, "--beam", str(beam))
    assert code == 0
    code, ct2_out, err = translate(ckpt, capsys, "--beam", str(beam), "--backend", "ctranslate2")
    assert code == 0, err
    # Greedy: token-identical by construction; beam 5 on sentences the model has memorised agrees too.
    assert ct2_out == torch_out and ct2_out.count("\n") == len(SRC) + 4
    assert ct2_out.splitlines()[len(SRC)] == ""  # a blank line stays blank
    assert (ckpt.parent / "m.pt.ct2" / "model.bin").is_file()


def test_the_export_is_made_once_and_remade_for_a_newer_checkpoint(ckpt, capsys, exports):
    pytest.importorskip("ctranslate2")
    for _ in range(2):
        assert translate(ckpt, capsys, "--beam", "1", "--backend", "ctranslate2")[0] == 0
    assert len(exports) == 1
    first = translate(ckpt, capsys, "--beam", "1", "--backend", "ctranslate2")[1]
    earlier = ckpt.stat().st_mtime_ns - 10**9
    os.utime(ckpt.parent / "m.pt.ct2" / "model.bin", ns=(earlier, earlier))  # the checkpoint rewritten after it
    code, out, err = translate(ckpt, capsys, "--beam", "1", "--backend", "ctranslate2")
    assert code == 0, err
    assert len(exports) == 2 and out == first
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["in.txt", "m.pt", "m.pt.ct2"]  # no temporary left
    assert translate(ckpt, capsys, "--beam", "1", "--backend", "ctranslate2")[0] == 0
    assert len(exports) == 2


def test_evaluate_scores_ctranslate2_as_torch(ckpt, capsys):
    pytest.importorskip("ctranslate2")
    (ckpt.parent / "ref.txt").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    (ckpt.parent / "in.txt").write_text("\n".join(SRC) + "\n", encoding="utf-8")
    results, files = {}, ["--src", str(ckpt.parent / "in.txt"), "--ref", str(ckpt.parent / "ref.txt")]
    for backend in ("torch", "ctranslate2"):
        out_dir = ckpt.parent / backend
        argv = [str(ckpt), *files, "--beam", "1", "--backend", backend, "--out-dir", str(out_dir)]
        assert evaluate_cli.main(argv) == 0, capsys.readouterr().err
        results[backend] = json.loads((out_dir / "in.txt.json").read_text(encoding="utf-8"))
        results[backend]["hyp"] = (out_dir / "in.txt.hyp").read_text(encoding="utf-8")
    assert results["ctranslate2"]["backend"] == "ctranslate2"
    for key in ("hyp", "bleu", "chrf"):
        assert results["ctranslate2"][key] == results["torch"][key]


def test_without_ctranslate2_installed_is_one_line(ckpt, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # what `import ctranslate2` meets when not installed
    code, out, err = translate(ckpt, capsys, "--backend", "ctranslate2")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "error:" in err and "pip install ctranslate2" in err
    assert not (ckpt.parent / "m.pt.ct2").exists()
    assert evaluate_cli.main([str(ckpt), "--src", str(ckpt.parent / "in.txt"), "--ref", str(ckpt.parent / "in.txt"),
                              "--backend", "ctranslate2"]) == 2
    assert "pip install ctranslate2" in capsys.readouterr().err


@pytest.mark.parametrize("err_no,exit_code", [(errno.EACCES, 2), (errno.EROFS, 5)])
def test_a_folder_that_cannot_take_the_export_is_one_line(ckpt, capsys, monkeypatch, err_no, exit_code):
    """A folder without write permission is the user's to fix (2); a read-only file system the machine's (5)."""
    pytest.importorskip("ctranslate2")
    from transformer import atomic

    def refuse(out):
        raise OSError(err_no, os.strerror(err_no), str(out))

    monkeypatch.setattr(atomic, "temp_dir_beside", refuse)  # root writes anywhere: the refusal is simulated
    code, out, err = translate(ckpt, capsys, "--backend", "ctranslate2")
    assert code == exit_code and out == ""
    assert err.count("\n") == 1 and "error:" in err and "m.pt.ct2" in err, err
    assert not (ckpt.parent / "m.pt.ct2").exists()


def test_two_commands_exporting_at_once_both_decode(ckpt, capsys, monkeypatch):
    """A second translate that finds the export renamed in by another while it exported takes that one: the same
    output, one cache folder, nothing of its own left beside it."""
    from transformer.interop import ct2

    real = ct2.export_ct2

    def racing(model, tokenizer, folder, *args, **kwargs):
        real(model, tokenizer, folder, *args, **kwargs)
        real(model, tokenizer, ckpt.parent / "other", *args, **kwargs)  # the other command's export...
        os.replace(ckpt.parent / "other", ckpt.parent / "m.pt.ct2")  # ...renamed in first

    code, expected, _ = translate(ckpt, capsys)
    monkeypatch.setattr(ct2, "export_ct2", racing)
    code, out, err = translate(ckpt, capsys, "--backend", "ctranslate2")
    assert code == 0, err
    assert out == expected
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["in.txt", "m.pt", "m.pt.ct2"]
