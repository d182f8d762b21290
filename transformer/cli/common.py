"""What the console programs share: the exit-code contract, one-line errors, and the decoding options of
translate and evaluate."""
import argparse
import sys
from typing import Callable, List, Optional, Sequence

import torch

from transformer import exit_codes
from transformer.config import ConfigError, EvalConfig, eval_from_dict
from transformer.config_checks import check_eval
from transformer.training.components.averaging import AverageError
from transformer.training.components.checkpoint import CheckpointError

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
    except OSError as e:  # a full or read-only disk (e.g. under --backend ctranslate2's export): the machine's
        from transformer.environment import describe, machine_error
        machine = machine_error(e)
        if machine is None:
            raise
        print(f"{prog}: error: {describe(machine, None)}", file=sys.stderr)
        return exit_codes.ENVIRONMENT
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
    g.add_argument("--max-source-tokens", type=int, default=None,
                   help="longer sources are truncated, with a warning (default: the checkpoint's data.max_len, the "
                        "longest sentence training kept; outputs are also bounded by the model's max_positions)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--threads", type=int, help="CPU threads of torch, and of CTranslate2 under --backend "
                   "ctranslate2 (default: the library's choice)")
    g.add_argument("--backend", default="torch", choices=["torch", "ctranslate2"],
                   help="decoder: torch (this project's search) or ctranslate2 (CTranslate2 on the CPU, from an "
                        "export made once beside the checkpoint, CHECKPOINT.ct2/, and remade when the checkpoint "
                        "is newer; greedy outputs equal torch's; needs `pip install ctranslate2`) "
                        "(default: %(default)s)")


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


def max_source_tokens(args: argparse.Namespace, ckpt: dict, model) -> int:
    """--max-source-tokens, by default the longest sentence training kept (data.max_len)."""
    trained_max = ((ckpt.get("config") or {}).get("data") or {}).get("max_len") or model.args.max_positions
    n = trained_max if args.max_source_tokens is None else args.max_source_tokens
    if n < 1:
        raise UsageError(f"--max-source-tokens {n}: must be >= 1")
    return n


def translate_lines(prog: str, model, tokenizer, lines: Sequence[str], cfg: EvalConfig, device, max_source: int,
                    name: str, first_line: int = 1, decode: Optional[Callable] = None) -> List[Optional[list]]:
    """The n-best lists of `lines` (as transformer/data/textfile.py reads them), None for a blank line: the model
    never sees one, and translate and evaluate both answer it with an empty line. Sources longer than
    `max_source` tokens are truncated, with a warning naming the line (`first_line` numbers lines[0]). `decode`:
    called as translate_ids is (transformer/interop/backend.py's for --backend ctranslate2), by default that."""
    from transformer.data.tokenizer import encode_sources
    from transformer.decoding import translate_ids

    keep = [i for i, s in enumerate(lines) if s.strip()]
    ids = encode_sources(tokenizer, [lines[i] for i in keep])
    for k, i in enumerate(keep):
        if len(ids[k]) > max_source:
            print(f"{prog}: warning: {name}, line {first_line + i}: {len(ids[k])} source tokens, truncated to "
                  f"{max_source} (--max-source-tokens)", file=sys.stderr)
            ids[k] = ids[k][:max_source]
    out: List[Optional[list]] = [None] * len(lines)
    decode = decode or translate_ids
    for i, nbest in zip(keep, decode(model, tokenizer, ids, cfg, device), strict=True):
        out[i] = nbest
    return out
