"""Text in, text out: raw sentences are tokenised, batched by length, searched, and detokenised."""
from typing import List, Optional, Sequence

import torch

from transformer.decoding.search import Hypothesis, search
from transformer.model.layers import no_cudnn_attention
from transformer.specials import EOS, PAD


def length_batches(lengths: Sequence[int], batch_tokens: int, max_sentences: Optional[int] = None) -> List[List[int]]:
    """Indices grouped into batches of similar source length (longest first, so an out-of-memory shows
    at once); a batch holds at most `batch_tokens` source tokens, padding included (fairseq's max_tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        n = max(longest, lengths[i])
        too_many = max_sentences is not None and len(current) >= max_sentences
        if current and (n * (len(current) + 1) > batch_tokens or too_many):
            batches.append(current)
            current, n = [], lengths[i]
        current.append(i)
        longest = n
    if current:
        batches.append(current)
    return batches


def encode_batch(id_lists: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Source id lists (no specials) -> (B, S) tensor of ids + </s>, right-padded."""
    S = max(len(ids) for ids in id_lists) + 1
    src = torch.full((len(id_lists), S), PAD, dtype=torch.long)
    for b, ids in enumerate(id_lists):
        src[b, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        src[b, len(ids)] = EOS
    return src.to(device)


def translate_sentences(model, tokenizer, sentences: Sequence[str], ev, device="cpu",
                        stop_at_eos: bool = True) -> List[List[Hypothesis]]:
    """Raw source sentences -> for each, in input order, its n-best list of `Hypothesis` (with `.text`,
    the detokenised translation). `ev` is an EvalConfig; sentences are batched by tokenised length
    (`ev.batch_tokens`)."""
    from transformer.data.tokenizer import encode_sources

    return translate_ids(model, tokenizer, encode_sources(tokenizer, sentences), ev, device, stop_at_eos)


def translate_ids(model, tokenizer, ids: Sequence[Sequence[int]], ev, device="cpu",
                  stop_at_eos: bool = True) -> List[List[Hypothesis]]:
    """translate_sentences for sources already tokenised (id lists without specials). Outputs never get
    more tokens than the model has positions (`model.args.max_positions`)."""
    device = torch.device(device)
    no_cudnn_attention(device)  # every decoding step is a new shape
    out: List[Optional[List[Hypothesis]]] = [None] * len(ids)
    for batch in length_batches([len(x) + 1 for x in ids], ev.batch_tokens):
        src = encode_batch([ids[i] for i in batch], device)
        for i, nbest in zip(batch, search(model, src, ev, stop_at_eos, model.args.max_positions), strict=False):
            for h in nbest:
                h.text = tokenizer.decode_tgt(h.tokens)
            out[i] = nbest
    return out
