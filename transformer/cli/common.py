"""What the console programs share: the exit-code contract, one-line errors, and the decoding options of
translate and evaluate."""
import argparse
import sys
from typing import Callable, Optional

import torch

from transformer import exit_codes
from transformer.config import ConfigError, EvalConfig, check_eval, eval_from_dict
from transformer.training.averaging import AverageError
from transformer.training.checkpoint import CheckpointError

# translate/evaluate decode with beam 5 unless --beam says otherwise. The checkpoint's eval.beam is what
# validation used during training (greedy by default, for speed) and is not the default here.
TEST_BEAM = 5


class UsageError(Exception):
    """Bad input from the user (an option, a file, the input text): one line, exit status 2."""


# Errors that are the user's input, not our bug: reported as one `error:` line.
USER_ERRORS = (UsageError, CheckpointError, AverageError)


def run_command(prog: str, fn: Callable[[], int]) -> int:
    """Runs a command's body with the contract: user errors print `PROG: error: MESSAGE` and exit 2."""
    try:
        return fn()
    except USER_ERRORS as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    except KeyboardInterrupt:
        return 130


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("decoding (an option given here wins; otherwise the checkpoint's eval config "
                                  "with the lenpen chosen on validation if training tuned it (eval.tune_lenpen), "
                                  f"except --beam, which defaults to {TEST_BEAM})")
    g.add_argument("--beam", type=int, default=TEST_BEAM, help="beam size; 1 = greedy (default: %(default)s)")
    g.add_argument("--lenpen", type=float, help="length penalty: hypotheses rank by logprob / length**lenpen")
    g.add_argument("--max-len-a", type=float, help="output limit a * source_length + b: the a")
    g.add_argument("--max-len-b", type=int, help="output limit a * source_length + b: the b")
    g.add_argument("--nbest", type=int, help="hypotheses written per sentence")
    g.add_argument("--batch-tokens", type=int, help="source tokens per batch, padding included")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's choice)")


def eval_config(args: argparse.Namespace, ckpt: dict) -> EvalConfig:
    """The checkpoint's `eval` settings with the command-line options on top, checked like the config's
    (an error names the option, e.g. `--nbest 6: must be between 1 and --beam=5`)."""
    ev = eval_from_dict((ckpt.get("config") or {}).get("eval"))
    tuned = ckpt.get("decoding") or {}  # chosen on validation at the end of training (eval.tune_lenpen)
    if "lenpen" in tuned:
        ev.lenpen = float(tuned["lenpen"])
    for key in ("beam", "lenpen", "max_len_a", "max_len_b", "nbest", "batch_tokens"):
        value = getattr(args, key)
        if value is not None:
            setattr(ev, key, value)
    if args.nbest is None:
        ev.nbest = min(ev.nbest, ev.beam)
    try:
        check_eval(ev, key="")
    except ConfigError as e:  # ".beam=0: must be >= 1" -> "--beam 0: must be >= 1"
        name, _, rest = str(e).partition("=")
        value, _, why = rest.partition(": ")
        flag = "--" + name.lstrip(".").replace("_", "-")
        raise UsageError(f"{flag} {value}: {why.replace('=', ' ').replace(' .', ' --')}") from None
    return ev


def pick_device(name: str, threads: Optional[int] = None) -> torch.device:
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads {threads}: must be >= 1")
        torch.set_num_threads(threads)
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
