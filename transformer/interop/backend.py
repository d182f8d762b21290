"""`--backend ctranslate2` of transformer-translate and transformer-evaluate: the checkpoint exported once to a
CTranslate2 folder beside it (`<checkpoint>.ct2/`) and decoded there on the CPU, by the rules of the project's
own search (transformer/decoding/search.py): the same output limit a * source length + b (the source's </s>
counted, at most the model's positions), beam size, length penalty and n-best, <pad> and <s> never output.
Greedy outputs are token-identical to the torch decoder's; beam outputs agree as docs/interop.md describes.
"""
import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from transformer.interop import InteropError

BACKENDS = ("torch", "ctranslate2")
# Permissions the user can change: bad input (exit 2). A read-only or full file system stays the machine's (5).
_DENIED = {errno.EACCES, errno.EPERM}


def require_ctranslate2():
    """The ctranslate2 module, or one line saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise InteropError("--backend ctranslate2: the ctranslate2 library is not installed: "
                           "pip install ctranslate2") from None
    return ctranslate2


def cache_dir(checkpoint) -> Path:
    """Where the CTranslate2 export of `checkpoint` (a file or an imported folder) is kept."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + ".ct2")


def _is_fresh(cache: Path, checkpoint: Path) -> bool:
    """The cache holds a finished export written after the checkpoint was last changed."""
    try:
        return (cache / "model.bin").stat().st_mtime_ns > checkpoint.stat().st_mtime_ns
    except OSError:
        return False


def ensure_export(checkpoint, model, tokenizer) -> Path:
    """The float32 CTranslate2 folder of `checkpoint` (whose loaded `model` and `tokenizer` are given): reused
    when newer than the checkpoint, else exported anew, built under a hidden name beside it and renamed, so a
    reader sees the old folder or the complete new one."""
    from transformer.atomic import fsync_dir, temp_dir_beside
    from transformer.interop.ct2 import export_ct2

    checkpoint = Path(checkpoint)
    cache = cache_dir(checkpoint)
    if _is_fresh(cache, checkpoint):
        return cache
    tmp = old = None
    try:
        tmp = temp_dir_beside(cache)  # empty: export_ct2 fills it by its own rename
        export_ct2(model, tokenizer, tmp)
        if cache.exists():  # an older export: moved aside, then the new one renamed in
            old = temp_dir_beside(cache)
            os.replace(cache, old)
        try:
            os.replace(tmp, cache)
            tmp = None
        except OSError as e:  # another command exported the same checkpoint meanwhile: its folder serves
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _is_fresh(cache, checkpoint):
                raise
        fsync_dir(cache.absolute().parent)
    except OSError as e:
        if e.errno in _DENIED:
            raise InteropError(f"--backend ctranslate2: cannot write its export {cache} beside the checkpoint "
                               f"({os.strerror(e.errno)}): make {cache.absolute().parent} writable, or copy the "
                               "checkpoint to a writable folder") from None
        raise  # a full or read-only disk: the machine's (exit 5)
    finally:
        for path in (tmp, old):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
    return cache


class Ct2Decoder:
    """Decodes source id lists with a CTranslate2 Translator on the CPU; called as
    `translate_ids(model, tokenizer, ids, ev, device)` is, and returning the same n-best lists of Hypothesis
    (`.score`: CTranslate2's, its logprob / length**lenpen, whose length leaves </s> out; `.logprob`: the
    summed log probability recovered from it)."""

    def __init__(self, folder, tokenizer, max_positions: int, threads: Optional[int] = None):
        ctranslate2 = require_ctranslate2()
        self.translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32",
                                                 intra_threads=threads or 0)
        self.max_positions = max_positions
        self.index: Dict[str, int] = {t: i for i, t in enumerate(tokenizer.tgt_tokens(range(tokenizer.tgt_vocab_size)))}

    def limits(self, ids: Sequence[Sequence[int]], ev) -> List[int]:
        """Each source's output limit, computed as the torch search computes it (its float32 arithmetic too)."""
        from transformer.decoding.search import max_lengths
        from transformer.decoding.translate import encode_batch

        return max_lengths(encode_batch(ids, "cpu"), ev.max_len_a, ev.max_len_b, self.max_positions).tolist()

    def __call__(self, model, tokenizer, ids: Sequence[Sequence[int]], ev, device=None) -> List[list]:
        from transformer.decoding.search import Hypothesis
        from transformer.interop.ct2 import SUPPRESSED
        from transformer.specials import EOS, SPECIALS

        out: List[Optional[list]] = [None] * len(ids)
        if not ids:
            return []
        by_limit: Dict[int, List[int]] = {}
        for i, limit in enumerate(self.limits(ids, ev)):
            by_limit.setdefault(limit, []).append(i)  # CTranslate2 takes one limit per call
        for limit, idx in sorted(by_limit.items()):
            sources = [tokenizer.src_tokens(ids[i]) + [SPECIALS[EOS]] for i in idx]
            results = self.translator.translate_batch(
                sources, beam_size=ev.beam, length_penalty=ev.lenpen, num_hypotheses=ev.nbest,
                max_decoding_length=limit, max_input_length=0, suppress_sequences=SUPPRESSED, return_scores=True,
                max_batch_size=ev.batch_tokens, batch_type="tokens")
            for i, r in zip(idx, results, strict=True):
                nbest = []
                for tokens, score in zip(r.hypotheses, r.scores, strict=True):
                    token_ids = [self.index[t] for t in tokens]
                    nbest.append(Hypothesis(token_ids, score, score * max(len(token_ids), 1) ** ev.lenpen,
                                            tokenizer.decode_tgt(token_ids)))
                out[i] = nbest
        return out


def decoder_for(backend: str, checkpoint, model, tokenizer, threads: Optional[int] = None):
    """The decoding function of `--backend`: None for the torch decoder (translate_ids), else a Ct2Decoder over
    the checkpoint's cached export."""
    if backend == "torch":
        return None
    require_ctranslate2()
    return Ct2Decoder(ensure_export(checkpoint, model, tokenizer), tokenizer, model.args.max_positions, threads)


@contextlib.contextmanager
def exported_decoder(model, tokenizer, threads: Optional[int] = None):
    """A Ct2Decoder over `model`'s weights as they are now, exported to a temporary folder that is removed after:
    validation's eval.backend=ctranslate2, whose weights change between validations (and may be the EMA's)."""
    from transformer.interop.ct2 import export_ct2

    require_ctranslate2()
    tmp = Path(tempfile.mkdtemp(prefix="transformer-ct2-"))
    try:
        yield Ct2Decoder(export_ct2(model, tokenizer, tmp / "model"), tokenizer, model.args.max_positions, threads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
