"""A dry run of Hydra's composition before Hydra itself runs: composition errors (an unknown key or
option, a bad override) and bad values fail as one `error:` line with exit code 2, before any run
directory is made, and a run directory that cannot be created is reported the same way."""
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, List

from hydra import compose, initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from transformer import exit_codes
from transformer.config import CONF_DIR, ConfigError
from transformer.training.launcher import USER_INPUT_ERRORS

# Lines of OmegaConf's messages that repeat what the first lines said.
_NOISE = ("object_type=", "reference_type=", "value=")


def one_line(e: BaseException) -> str:
    """The messages of an exception and its causes, joined into one line."""
    parts: List[str] = []
    while e is not None and len(parts) < 3:
        message = str(e).split("Config search path")[0]  # Hydra's list of folders it looked in
        text = " ".join(line.strip() for line in message.splitlines()
                        if line.strip() and not line.strip().startswith(_NOISE))
        if text and text not in parts:
            parts.append(text)
        e = e.__cause__
    return " | ".join(parts)


def first_values(overrides: List[str]) -> List[str]:
    """A sweep's first job (`a=1,2` -> `a=1`): enough to check every key and option of a multirun."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override() else o.input_line
            for o in parsed]


def check_creatable(key: str, folder: Path) -> None:
    """`folder` exists and is writable, or can be created (tried with a probe folder, removed at once)."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={str(folder)!r}: {existing} is a file, not a folder")
    if existing == folder:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={str(folder)!r}: not writable")
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".transformer-probe-", dir=existing))
    except OSError as e:
        raise ConfigError(f"{key}={str(folder)!r}: cannot create folders in {existing} ({e.strerror})") from None


def add_config_dir(config_dir: str) -> None:
    """Inside initialize_config_dir(CONF_DIR): a user's `--config-dir` (recipes of their own) searched after conf/,
    where hydra.main puts it (the compose API takes one folder only)."""
    folder = Path(config_dir).absolute()
    if not folder.is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such folder")
    search_path = create_config_search_path(str(CONF_DIR))
    search_path.prepend("command-line", f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()  # initialize_config_dir restores the one it replaced on exit
    Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)


def precheck(argv: List[str], check: Callable, writes: bool = True) -> int:
    """0 if the command line composes and `check(cfg)` accepts it, else the exit code after one error line.
    `writes`: this process makes the run directory (torchrun ranks other than 0 write nothing, and on a
    shared file system rank 0's folder is often not writable for them)."""
    args = get_args_parser().parse_args(argv)
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun
            or args.config_path or args.config_name):
        return exit_codes.OK  # Hydra's own modes: let Hydra answer them
    try:
        overrides = first_values(args.overrides) if args.multirun else args.overrides
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            if args.config_dir is not None:
                add_config_dir(args.config_dir)
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        check(cfg)
        if writes:
            key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
            check_creatable(key, Path(cfg.hydra.sweep.dir if args.multirun else cfg.hydra.run.dir))
    except (HydraException, OmegaConfBaseException, *USER_INPUT_ERRORS) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return exit_codes.USER_ERROR
    return exit_codes.OK
