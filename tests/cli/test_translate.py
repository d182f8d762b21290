"""transformer-translate: file, pipe and stdin input, input order, n-best output, line-by-line interactive use,
and one-line errors for bad input."""
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.models import VOCAB, copy_checkpoint, copy_model, one_thread, random_copy_items  # noqa: F401
from tests.helpers.textfiles import fifo
from transformer.cli.translate import main
from transformer.config import EvalConfig
from transformer.data.copy import CopyTokenizer
from transformer.decoding import translate_sentences
from transformer.training.components.checkpoint import atomic_save

REPO = Path(__file__).resolve().parents[2]


def stdin_of(text: str) -> io.TextIOWrapper:
    """A stand-in for sys.stdin (a text stream over bytes, read through its .buffer)."""
    return io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8")


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    atomic_save(copy_checkpoint(), path)
    return path


@pytest.fixture(scope="module")
def sentences():
    return [" ".join(str(t) for t in s) for _, s, _ in random_copy_items(40, seed=5)]


def test_file_to_file_matches_the_library_in_input_order(ckpt_path, sentences, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    rc = main([str(ckpt_path), "--input", str(src), "--output", str(out), "--beam", "3", "--batch-tokens", "20",
               "--buffer-size", "7"])
    assert rc == 0
    lines = out.read_text(encoding="utf-8").split("\n")[:-1]
    expected = translate_sentences(copy_model(), CopyTokenizer(VOCAB), sentences, EvalConfig(beam=3), "cpu")
    assert lines == [n[0].text for n in expected]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_stdin_to_stdout_keeps_empty_lines(ckpt_path, sentences, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", stdin_of(f"{sentences[0]}\n\n{sentences[1]}\n"))
    assert main([str(ckpt_path), "--beam", "1"]) == 0
    lines = capsys.readouterr().out.split("\n")
    expected = translate_sentences(copy_model(), CopyTokenizer(VOCAB), sentences[:2], EvalConfig(beam=1), "cpu")
    assert lines == [expected[0][0].text, "", expected[1][0].text, ""]


def test_input_from_a_named_pipe_and_from_dev_null(ckpt_path, sentences, tmp_path, capsys):
    expected = translate_sentences(copy_model(), CopyTokenizer(VOCAB), sentences[:5], EvalConfig(beam=2), "cpu")
    with fifo(tmp_path / "pipe", ("\n".join(sentences[:5]) + "\n").encode()) as pipe:
        assert main([str(ckpt_path), "--input", str(pipe), "--beam", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [n[0].text for n in expected]
    assert main([str(ckpt_path), "--input", "/dev/null", "--output", str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_bytes() == b""  # nothing in, nothing out: no error


def test_input_from_a_process_substitution(ckpt_path, sentences):
    """The issue's own command line: `--input <(...)`, a /dev/fd/N pipe made by bash."""
    cmd = (f"{shlex.quote(sys.executable)} -m transformer.cli.translate {shlex.quote(str(ckpt_path))} --beam 2 "
           f"--threads 1 --input <(printf '%s\\n' {shlex.quote(sentences[0])} {shlex.quote(sentences[1])})")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    expected = translate_sentences(copy_model(), CopyTokenizer(VOCAB), sentences[:2], EvalConfig(beam=2), "cpu")
    assert res.stdout.splitlines() == [n[0].text for n in expected]


def test_nbest_output(ckpt_path, sentences, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", stdin_of("\n".join(sentences[:2]) + "\n"))
    assert main([str(ckpt_path), "--beam", "4", "--nbest", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert [ln.split(" ||| ")[0] for ln in lines] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(ln.split(" ||| ")[2]) for ln in lines[:3]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("argv, message", [
    (["{missing}"], "no such checkpoint file"),
    (["{ckpt}", "--beam", "2", "--nbest", "3"], "--nbest 3"),
    (["{ckpt}", "--beam", "0"], "--beam 0"),
    (["{ckpt}", "--input", "{missing}"], "--input {missing}: no such file"),
    (["{ckpt}", "--input", "{folder}"], "--input {folder}: is a folder, not a file"),
    (["{garbage}"], "not a checkpoint"),
])
def test_bad_input_is_one_line_and_nonzero(argv, message, ckpt_path, tmp_path, capsys):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    out = tmp_path / "out.txt"
    names = {"missing": tmp_path / "nope.pt", "ckpt": ckpt_path, "garbage": garbage, "folder": tmp_path}
    argv, message = [a.format(**names) for a in argv], message.format(**names)
    assert main(argv + ["--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("transformer-translate: error:")
    assert not out.exists()


def test_mismatched_weights_are_refused(tmp_path, capsys):
    ckpt = copy_checkpoint()
    ckpt["model_args"] = dict(ckpt["model_args"], d_ff=128)  # weights no longer fit the architecture
    path = tmp_path / "bad.pt"
    atomic_save(ckpt, path)
    assert main([str(path)]) == 2
    assert "broken checkpoint" in capsys.readouterr().err


def test_interactive_answers_each_line_before_the_next_arrives(ckpt_path, sentences):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "transformer.cli.translate", str(ckpt_path), "--interactive",
                             "--beam", "2", "--threads", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        answers = []
        for s in sentences[:3]:
            proc.stdin.write(s + "\n")
            proc.stdin.flush()
            answers.append(proc.stdout.readline().rstrip("\n"))  # blocks unless the line was flushed
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    expected = translate_sentences(copy_model(), CopyTokenizer(VOCAB), sentences[:3], EvalConfig(beam=2), "cpu")
    assert answers == [n[0].text for n in expected]
