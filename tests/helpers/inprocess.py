"""A command's main() run in this process, returned as a subprocess's result (exit code, standard output, standard
error): without the interpreter's start and torch's import, seconds a run. For tests of what a command does and
says; each command keeps a test that starts it as a real process (its process-level contract)."""
import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional


def call_main(main: Callable, argv: list, cwd: Path, env: Optional[dict] = None, prog: str = "transformer",
              capture=None) -> subprocess.CompletedProcess:
    """main() with sys.argv = [prog, *argv] in `cwd` (and the environment `env` where given), its output captured:
    by pytest's `capture` fixture where given (capfd: what C libraries write to the file descriptors too), else
    sys.stdout and sys.stderr. The working folder, environment, argv, root logger and torch's threads (commands
    set up their own) are restored after."""
    out, err = io.StringIO(), io.StringIO()
    if capture is not None:
        capture.readouterr()  # what came before is not the command's
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None  # training sets its own
    saved_argv, here, environ = sys.argv, os.getcwd(), dict(os.environ)
    code = 0
    try:
        sys.argv = [prog, *map(str, argv)]
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        redirect = capture is None
        with contextlib.redirect_stdout(out) if redirect else contextlib.nullcontext(), \
                contextlib.redirect_stderr(err) if redirect else contextlib.nullcontext():
            try:
                result = main()
                code = result if isinstance(result, int) else 0
            except SystemExit as e:  # as the interpreter turns it into an exit status
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        sys.argv = saved_argv
        os.chdir(here)
        if env is not None:
            os.environ.clear()
            os.environ.update(environ)
        root.handlers[:] = handlers
        root.setLevel(level)
        if threads is not None:
            torch.set_num_threads(threads)
    outputs = capture.readouterr() if capture is not None else (out.getvalue(), err.getvalue())
    return subprocess.CompletedProcess([prog, *map(str, argv)], code, *outputs)


def bench_in_process(cwd: Path, *overrides: str, expect: int = 0, env: Optional[dict] = None
                     ) -> subprocess.CompletedProcess:
    """`transformer-bench <overrides>` in this process (tests/training/tools/test_bench.py's bench() starts it as a
    process)."""
    from transformer.cli import bench as bench_cli

    res = call_main(bench_cli.main, list(overrides), cwd, env, prog="transformer-bench")
    assert res.returncode == expect, res.stderr[-4000:]
    return res
