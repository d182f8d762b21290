"""The exit-code contract of every command: bad input is one `error:` line (naming the key, file, line or
value), exit code 2, no traceback, and nothing written; a refused run leaves an existing run directory
byte for byte as it was."""
import hashlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import cli_env, train_cmd
from tests.helpers.dist import TINY
from tests.helpers.inprocess import call_main
from tests.helpers.models import copy_checkpoint, one_thread  # noqa: F401 (autouse fixture)
from transformer.cli import average, evaluate, plot, translate
from transformer.cli import train as train_cli
from transformer.training.components.checkpoint import atomic_save


def run_train(cwd: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(*overrides), cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def assert_one_error_line(stderr: str, *fragments: str, prog: str = "") -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(f"{prog}: error: " if prog else "error: ")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def tree_digest(folder: Path) -> dict:
    """Every file below `folder` (relative path -> sha256), folders included as entries."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


# ---- transformer-train ------------------------------------------------------------------------------
TRAIN_CASES = [
    (["optim.lrr=1"], ["optim.lrr", "Key 'lrr' not in 'OptimConfig'"]),
    (["experiment=nope"], ["experiment/nope", "copy"]),
    (["model.d_model=100", "model.h=7"], ["model.d_model=100", "model.h=7"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps", "'abc'"]),
    (["experiment=copy", "checkpoint.best_metric=val_bleu"], ["checkpoint.best_metric", "val_accuracy"]),
    (["experiment=copy", "trainer.resume=missing.pt"], ["trainer.resume", "missing.pt"]),
    (["-m", "experiment=copy", "model.norm_first=false,true", "trainer.lr=1"], ["trainer.lr"]),
    (["experiment=copy", "hydra.run.dir=notes.txt/run"], ["hydra.run.dir", "is a file, not a folder"]),
    (["data=files", "data.files.train=nowhere/train", "data.files.val=nowhere/val", *TINY[1:], "trainer.max_steps=2"],
     ["nowhere/train"]),
    (["experiment=copy", "data.bpe_dropout=0.1"], ["data.bpe_dropout=0.1", "needs tokenizer=bpe"]),
    (["experiment=multi30k", "data.bpe_dropout=1.5"], ["data.bpe_dropout=1.5", "must be >= 0 and < 1"]),
]
if not torch.cuda.is_available():
    TRAIN_CASES.append((["experiment=copy", "trainer.accelerator=gpu", "trainer.devices=2"],
                        ["trainer.accelerator", "no CUDA GPU"]))


@pytest.mark.parametrize("overrides, fragments", TRAIN_CASES, ids=lambda v: " ".join(v)[:60] if v else "")
def test_train_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, overrides, fragments, capfd):
    """The first case starts the command as a process; the others run its main() in this process, what is
    written to the file descriptors captured as from a process."""
    (tmp_path / "notes.txt").write_text("not a folder\n")
    before = tree_digest(tmp_path)
    if overrides == TRAIN_CASES[0][0]:
        r = run_train(tmp_path, *overrides)
    else:
        r = call_main(train_cli.main, overrides, tmp_path, prog="transformer-train", capture=capfd)
    assert r.returncode == 2, r.stderr
    assert_one_error_line(r.stderr, *fragments)
    assert tree_digest(tmp_path) == before  # no outputs/, no multirun/, no .hydra


def test_a_busy_master_port_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    """A worker started as torchrun or srun start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), rank 0 of 2,
    with MASTER_PORT held by another process: the launcher's setting, named in one line (it was a traceback
    and "internal error", exit code 1)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**cli_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        before = tree_digest(tmp_path)
        r = subprocess.run(train_cmd(*TINY, "trainer.max_steps=2", "trainer.timeout_s=30"), cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr
    assert_one_error_line(r.stderr, f"MASTER_PORT={port}: address already in use on 127.0.0.1")
    assert tree_digest(tmp_path) == before


@pytest.mark.slow
def test_refused_runs_leave_an_existing_run_directory_byte_identical(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(tmp_path, *TINY, "trainer.max_steps=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    before = tree_digest(run_dir)
    assert ".hydra/config.yaml" in before and any(k.startswith("checkpoints/step_") for k in before)
    for overrides, fragment in (
            (["optim.lrr=1"], "optim.lrr"),
            (["trainer.devices=2", "trainer.accelerator=cpu"], "written by 1 workers but this run has 2"),
            (["data.copy.vocab_size=3"], "data.copy.vocab_size")):
        r = run_train(tmp_path, *TINY, "trainer.max_steps=4", f"hydra.run.dir={run_dir}", *overrides)
        assert r.returncode == 2, r.stderr
        assert_one_error_line(r.stderr, fragment)
        assert tree_digest(run_dir) == before, overrides


# ---- translate, evaluate, average, plot ----------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract")
    atomic_save(copy_checkpoint(), folder / "model.pt")
    (folder / "text.txt").write_text("4 5 6\n", encoding="utf-8")
    torch.save({"format": "transformer-checkpoint/1", "x": io.BytesIO()}, folder / "pickled.pt")
    (folder / "truncated.pt").write_bytes((folder / "model.pt").read_bytes()[:1000])
    lines = [b"4 5 6\n"] * 5 + [b"4 \xff 5\n"] + [b"6 7\n"] * 3
    (folder / "bad_utf8.txt").write_bytes(b"".join(lines))
    (folder / "src.txt").write_text("4 5\n6 7\n", encoding="utf-8")
    (folder / "ref.txt").write_text("4 5\n", encoding="utf-8")
    return folder


COMMAND_CASES = [
    (translate, ["{d}/missing.pt"], ["missing.pt", "no such checkpoint file"]),
    (translate, ["{d}/text.txt"], ["text.txt", "not a checkpoint"]),
    (translate, ["{d}/pickled.pt"], ["pickled.pt", "executable pickled objects: refused"]),
    (translate, ["{d}/truncated.pt"], ["truncated.pt", "truncated or corrupt"]),
    (translate, ["{d}/model.pt", "--input", "{d}/bad_utf8.txt"], ["bad_utf8.txt, line 6", "invalid UTF-8"]),
    (translate, ["{d}/model.pt", "--beam", "0"], ["--beam 0"]),
    (translate, ["{d}/model.pt", "--beam", "2", "--nbest", "3"], ["--nbest 3"]),
    (translate, ["{d}/model.pt", "--input", "{d}/src.txt", "--output", "{d}/no/such/out.txt"], ["--output"]),
    (translate, ["{d}/model.pt", "--max-source-tokens", "0"], ["--max-source-tokens 0"]),
    (translate, ["{d}/model.pt", "--input", "{d}/src.txt", "--output", "{d}"], ["--output", "is a folder"]),
    (translate, ["{d}/model.pt", "--buffer-size", "0"], ["--buffer-size 0", "must be >= 1"]),
    (evaluate, ["{d}/model.pt", "--src", "{d}/src.txt", "--ref", "{d}/ref.txt"], ["has 2 lines", "has 1"]),
    (evaluate, ["{d}/model.pt", "--src", "{d}/bad_utf8.txt", "--ref", "{d}/ref.txt"], ["bad_utf8.txt", "line 6"]),
    (evaluate, ["{d}/model.pt"], ["--split"]),
    (average, ["{d}/model.pt", "{d}/model.pt", "--output", "{d}/avg.pt"], ["twice"]),
    (average, ["{d}", "--last", "3"], ["fewer than --last 3"]),
    (average, ["{d}/model.pt", "{d}/text.txt", "--output", "{d}/avg.pt"], ["text.txt"]),
    (plot, ["{d}/no_run"], ["no_run", "no such run directory"]),
]


@pytest.mark.parametrize("command, argv, fragments", COMMAND_CASES,
                         ids=lambda v: v.__name__.rsplit(".", 1)[-1] if hasattr(v, "__name__") else
                         (" ".join(v)[:50] if isinstance(v, list) else None))
def test_commands_bad_input_is_one_line_exit_2(files, command, argv, fragments, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"4 5\n"), encoding="utf-8"))
    before = tree_digest(files)
    assert command.main([a.format(d=files) for a in argv]) == 2
    assert_one_error_line(capsys.readouterr().err, *fragments, prog=command.PROG)
    assert tree_digest(files) == before


def test_translate_truncates_over_long_sources_with_a_warning_per_line(files, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"4 5\n" + b"6 " * 40 + b"\n"), encoding="utf-8"))
    assert translate.main([str(files / "model.pt"), "--max-source-tokens", "8", "--beam", "1"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    assert err.count("warning") == 1 and "line 2: 40 source tokens, truncated to 8" in err


@pytest.mark.parametrize("module, args, fragment, process", [
    ("transformer.cli.bench", ["optim.lrr=1"], "optim.lrr", True),
    ("transformer.cli.bench", ["bench.steps=0"], "bench.steps=0", False),
    ("transformer.cli.preprocess", ["data.max_len=0", "preprocess.out_dir=out"], "data.max_len=0", True),
    ("transformer.cli.preprocess", ["tokenizer=nope", "preprocess.out_dir=out"], "tokenizer/nope", False),
])
def test_bench_and_preprocess_bad_input_is_one_line_exit_2(tmp_path, module, args, fragment, process, capfd):
    """One case of each command starts it as a process, the other runs its main() in this process."""
    import importlib

    before = tree_digest(tmp_path)
    if process:
        r = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=240)
    else:
        r = call_main(importlib.import_module(module).main, args, tmp_path, capture=capfd)
    assert r.returncode == 2, r.stderr
    assert_one_error_line(r.stderr, fragment)
    assert tree_digest(tmp_path) == before


def test_only_the_writing_rank_checks_the_run_directory(tmp_path, monkeypatch):
    """Under torchrun only global rank 0 makes the run directory; on a shared file system the other nodes
    often cannot write into it (another uid), and refusing the run there left rank 0 waiting for them."""
    from transformer.cli import compose
    from transformer.cli import train as train_cli

    train_cli.register_configs()
    (tmp_path / "notes.txt").write_text("not a folder\n")
    argv = ["experiment=copy", f"hydra.run.dir={tmp_path / 'notes.txt' / 'run'}"]
    assert compose.precheck(argv, train_cli.check) == 2
    assert compose.precheck(argv, train_cli.check, writes=False) == 0

    seen = []
    monkeypatch.setattr(train_cli, "precheck", lambda argv, check, writes: seen.append(writes) or 2)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(sys, "argv", ["transformer-train", *argv])
        with pytest.raises(SystemExit):
            train_cli.main()
    assert seen == [True, False]


def test_evaluate_never_downloads_into_a_data_root(tmp_path, capsys, monkeypatch):
    """A --data-root is a dataset folder: a split missing there is an error naming the flag, with no network
    call and nothing made inside the folder (no .part file, no multi30k/)."""
    import urllib.request

    ckpt = copy_checkpoint()
    ckpt["config"]["data"]["name"] = "multi30k"
    atomic_save(ckpt, tmp_path / "model.pt")
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("network access attempted"))
    before = tree_digest(tmp_path)
    argv = [str(tmp_path / "model.pt"), "--split", "test_2017_flickr", "--data-root", str(dataset)]
    assert evaluate.main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, "--split test_2017_flickr", "test_2017_flickr.de.gz",
                          "point --data-root at", prog=evaluate.PROG)
    assert tree_digest(tmp_path) == before
