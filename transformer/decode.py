"""Decoding: batched greedy and beam search with the incremental (key/value-cached) decoder.

Both searches keep one row per live hypothesis and drop sentences as soon as they are finished, so a
batch costs what its longest unfinished sentence costs. With `use_cache=True` (the default) each step
feeds only the newest token: the decoder self-attention keys/values of earlier positions and the
cross-attention keys/values of the encoder output (computed once per source by `model.new_cache`) come
from a `DecoderCache`, which beam search reorders to follow the surviving hypotheses. With
`use_cache=False` every step re-runs the decoder on the whole prefix (the Annotated Transformer's way);
it gives the same hypotheses and exists for tests and benchmarks.

Scores follow fairseq: a finished hypothesis of n tokens (its </s> included) with summed log
probability L scores L / n**lenpen. lenpen = 1 ranks by the mean log probability per token, lenpen = 0
by the total (which favours short outputs); larger values favour longer outputs. A hypothesis gets at
most `max_len_a * source_length + max_len_b` tokens before its </s> (source length counts the source's
</s>); at that point </s> is forced.
"""
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from transformer.data.batch import BOS, EOS, PAD
from transformer.model import Transformer


@dataclass
class Hypothesis:
    tokens: List[int]  # target ids, without <s> and </s>
    score: float  # logprob / length**lenpen (the ranking score)
    logprob: float  # summed log probability, the final </s> included when it was produced
    text: Optional[str] = None  # detokenised, filled in by `translate_sentences`
    positional: List[float] = field(default_factory=list)  # log probability of each token (+ </s>)


def max_lengths(src: torch.Tensor, a: float, b: int) -> torch.Tensor:
    """Per-sentence output limit a * source length + b (source length without padding)."""
    return ((src != PAD).sum(dim=1).float() * a + b).long().clamp(min=1)  # (B,)


def _unwrap(model):
    # DistributedDataParallel keeps the model in `.module`; encode/decode live there.
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def decode_last(model, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
    """Uncached step: the decoder re-run over the whole prefix tokens (R, T), the output projection applied
    to the last position only (as the Annotated Transformer does) -> logits (R, V)."""
    if not isinstance(model, Transformer):
        return model.decode(tokens, memory, src_mask)[:, -1]
    x = model.tgt_embed(tokens)  # (R, T, D)
    for layer in model.decoder:
        x = layer(x, layer.cross_attn.project_kv(memory), src_mask)
    return model.generator(model.dec_norm(x[:, -1]))  # (R, V)


def _step_logprobs(model, tokens, memory, src_mask, cache) -> torch.Tensor:
    """Log probabilities of the next token for every row, (R, V) in fp32."""
    if cache is not None:
        logits = model.decode(tokens[:, -1:], cache=cache)[:, -1]  # (R, V)
    else:
        logits = decode_last(model, tokens, memory, src_mask)  # the whole prefix again
    lprobs = F.log_softmax(logits.float(), dim=-1)
    lprobs[:, PAD] = -float("inf")
    lprobs[:, BOS] = -float("inf")
    return lprobs


class _eval_mode:
    """Eval mode (no dropout) inside, the caller's mode restored after (validation runs mid-training)."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


@torch.no_grad()
def greedy_search(model, src: torch.Tensor, lenpen: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                  use_cache: bool = True, stop_at_eos: bool = True) -> List[Hypothesis]:
    """src (B, S) -> the most probable next token at each step, one Hypothesis per sentence.
    A sentence stops at </s> or its length limit; `stop_at_eos=False` bans </s> so every output has
    exactly its limit's length (for speed measurements)."""
    model = _unwrap(model)
    with _eval_mode(model):
        B, device = src.size(0), src.device
        memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        cache = model.new_cache(memory, src_mask) if use_cache else None
        limits = max_lengths(src, max_len_a, max_len_b)  # (B,)
        alive = torch.arange(B, device=device)  # original index of each row
        tokens = torch.full((B, 1), BOS, dtype=torch.long, device=device)  # (R, t+1)
        logps = torch.zeros(B, 0, device=device)  # (R, t)
        results: List[Optional[Hypothesis]] = [None] * B
        for t in range(int(limits.max())):
            lprobs = _step_logprobs(model, tokens, memory, src_mask, cache)  # (R, V)
            if not stop_at_eos:
                lprobs[:, EOS] = -float("inf")
            logp, nxt = lprobs.max(dim=-1)  # (R,)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            logps = torch.cat([logps, logp[:, None]], dim=1)
            done = (nxt == EOS) | (t + 1 >= limits[alive])
            if not bool(done.any()):
                continue
            for r in done.nonzero().flatten().tolist():
                ids, lp = tokens[r, 1:].tolist(), logps[r].tolist()
                if ids[-1] == EOS:
                    ids = ids[:-1]
                total = sum(lp)
                results[int(alive[r])] = Hypothesis(ids, total / len(lp) ** lenpen, total, positional=lp)
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            alive, tokens, logps = alive[keep], tokens[keep], logps[keep]
            if cache is not None:
                cache.reorder(keep)
            else:
                memory, src_mask = memory.index_select(0, keep), src_mask.index_select(0, keep)
        return results


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, max_len_a: float = 1.2, max_len_b: int = 10,
                  use_cache: bool = True, stop_at_eos: bool = True) -> List[List[int]]:
    """src (B, S) -> one token list per sentence, without <s>/</s>. A sentence stops at </s> or its limit."""
    return [h.tokens for h in greedy_search(model, src, 1.0, max_len_a, max_len_b, use_cache, stop_at_eos)]


def _reorder_beams(cache, parent: torch.Tensor, keep_rows: Optional[torch.Tensor]) -> None:
    """Follows the surviving hypotheses. A hypothesis' parent is always a beam of the same sentence, and
    the K rows of a sentence hold the same encoder keys/values, so those only move when finished
    sentences leave the batch (`keep_rows`); copying them every step would cost ~15% of beam search."""
    if not (hasattr(cache, "self_attn") and hasattr(cache, "cross_kv")):
        cache.reorder(parent)  # some other cache type: reorder everything
        return
    for layer in cache.self_attn:
        for key in list(layer):
            layer[key] = layer[key].index_select(0, parent)
    if keep_rows is not None:
        cache.cross_kv = [(k.index_select(0, keep_rows), v.index_select(0, keep_rows)) for k, v in cache.cross_kv]
        cache.src_mask = cache.src_mask.index_select(0, keep_rows)


@torch.no_grad()
def beam_search(model, src: torch.Tensor, beam: int = 5, lenpen: float = 1.0, max_len_a: float = 1.2,
                max_len_b: int = 10, nbest: int = 1, use_cache: bool = True,
                stop_at_eos: bool = True) -> List[List[Hypothesis]]:
    """src (B, S) -> for each sentence its `nbest` best finished hypotheses, best first.

    fairseq's procedure: every step takes the 2*beam best extensions of the sentence's beam; those
    ending in </s> among the top `beam` are finished, the best `beam` others continue. A sentence is
    done once it has `beam` finished hypotheses (at the length limit all of its live ones finish).
    """
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"beam={beam}, nbest={nbest}: need beam >= 1 and 1 <= nbest <= beam")
    model = _unwrap(model)
    with _eval_mode(model):
        B, K, device = src.size(0), beam, src.device
        memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,) each sentence K times
        memory, src_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)
        cache = model.new_cache(memory, src_mask) if use_cache else None
        limits = max_lengths(src, max_len_a, max_len_b)  # (B,)
        alive = torch.arange(B, device=device)  # original index of each live sentence
        tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=device)  # (R*K, t+1)
        logps = torch.zeros(B * K, 0, device=device)  # (R*K, t) per-token log probabilities
        # Only the first copy of each sentence is live at step 0, so the K beams start out different.
        scores = torch.full((B, K), -float("inf"), device=device)
        scores[:, 0] = 0.0
        finished: List[List[Hypothesis]] = [[] for _ in range(B)]
        for t in range(int(limits.max()) + 1):
            R = alive.numel()
            lprobs = _step_logprobs(model, tokens, memory, src_mask, cache)  # (R*K, V)
            V = lprobs.size(1)
            if not stop_at_eos:
                lprobs[:, EOS] = -float("inf")
            at_limit = (t >= limits[alive]).repeat_interleave(K)  # (R*K,): only </s> may follow
            if bool(at_limit.any()):
                eos = lprobs[at_limit, EOS]
                lprobs[at_limit] = -float("inf")
                lprobs[at_limit, EOS] = torch.where(torch.isfinite(eos), eos, torch.zeros_like(eos))
            cand = (scores.view(R * K, 1) + lprobs).view(R, K * V)
            top, idx = cand.topk(min(2 * K, K * V), dim=1)  # (R, 2K)
            src_beam, tok = idx // V, idx % V
            is_eos = (tok == EOS) & torch.isfinite(top)
            done = torch.zeros(R, dtype=torch.bool, device=device)
            if bool(is_eos[:, :K].any()):
                for r, j in is_eos[:, :K].nonzero().tolist():
                    b = int(alive[r])
                    if len(finished[b]) >= K:
                        continue
                    row = r * K + int(src_beam[r, j])
                    lp = logps[row].tolist() + [float(lprobs[row, EOS])]
                    total = float(top[r, j])
                    finished[b].append(Hypothesis(tokens[row, 1:].tolist(), total / (t + 1) ** lenpen, total,
                                                  positional=lp))
                    done[r] = len(finished[b]) >= K
            # The K best candidates not ending in </s> continue: sort key puts </s> candidates last.
            order = is_eos.long() * idx.size(1) + torch.arange(idx.size(1), device=device)
            active = order.topk(K, dim=1, largest=False).indices  # (R, K)
            scores = top.gather(1, active)
            new_tok = tok.gather(1, active).view(-1)
            parent = (torch.arange(R, device=device)[:, None] * K + src_beam.gather(1, active)).view(-1)
            tokens = torch.cat([tokens[parent], new_tok[:, None]], dim=1)
            logps = torch.cat([logps[parent], lprobs[parent, new_tok][:, None]], dim=1)
            done |= ~torch.isfinite(scores).any(dim=1)  # nothing live left (tiny vocabularies)
            keep_rows = None
            if bool(done.any()):
                keep = (~done).nonzero().flatten()
                if keep.numel() == 0:
                    break
                keep_rows = (keep[:, None] * K + torch.arange(K, device=device)).view(-1)
                alive, scores = alive[keep], scores[keep]
                tokens, logps, parent = tokens[keep_rows], logps[keep_rows], parent[keep_rows]
            if cache is not None:
                _reorder_beams(cache, parent, keep_rows)
            else:
                memory, src_mask = memory.index_select(0, parent), src_mask.index_select(0, parent)
        # A sentence with nothing finished (only possible with a vocabulary of specials) gets an empty output.
        return [sorted(hyps, key=lambda h: -h.score)[:nbest] or [Hypothesis([], -float("inf"), -float("inf"))]
                for hyps in finished]


def option(cfg, name: str, default=None):
    """cfg.name for an EvalConfig or DictConfig, cfg[name] for a dict; `default` when absent."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def search(model, src: torch.Tensor, eval_cfg=None, use_cache: bool = True,
           stop_at_eos: bool = True) -> List[List[Hypothesis]]:
    """Greedy search when eval.beam == 1, else beam search; `eval_cfg` is an EvalConfig (or a dict/DictConfig
    with its keys). Returns the n-best list of each sentence."""
    beam, nbest = int(option(eval_cfg, "beam", 1)), int(option(eval_cfg, "nbest", 1))
    lenpen = float(option(eval_cfg, "lenpen", 1.0))
    a, b = float(option(eval_cfg, "max_len_a", 1.2)), int(option(eval_cfg, "max_len_b", 10))
    if beam == 1 and nbest == 1:
        return [[h] for h in greedy_search(model, src, lenpen, a, b, use_cache, stop_at_eos)]
    return beam_search(model, src, beam, lenpen, a, b, nbest, use_cache, stop_at_eos)


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


def translate_sentences(model, tokenizer, sentences: Sequence[str], eval_cfg=None, device="cpu",
                        use_cache: bool = True) -> List[List[Hypothesis]]:
    """Raw source sentences -> for each, in input order, its n-best list of `Hypothesis` (with `.text`,
    the detokenised translation). Sentences are batched by tokenised length (`eval.batch_tokens`)."""
    from transformer.data.tokenizer import encode_sources

    device = torch.device(device)
    ids = encode_sources(tokenizer, sentences)
    batch_tokens = int(option(eval_cfg, "batch_tokens", 8000))
    out: List[Optional[List[Hypothesis]]] = [None] * len(ids)
    for batch in length_batches([len(x) + 1 for x in ids], batch_tokens):
        src = encode_batch([ids[i] for i in batch], device)
        for i, nbest in zip(batch, search(model, src, eval_cfg, use_cache=use_cache)):
            for h in nbest:
                h.text = tokenizer.decode_tgt(h.tokens)
            out[i] = nbest
    return out
