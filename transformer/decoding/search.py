"""Batched greedy and beam search over the incremental (key/value-cached) decoder.

Both searches keep one row per live hypothesis and drop sentences as soon as they are finished, so a
batch costs what its longest unfinished sentence costs. Each step feeds only the newest token: the
decoder self-attention keys/values of earlier positions and the cross-attention keys/values of the
encoder output (computed once per source, for all layers in one product, by `model.new_cache`) come from
a `DecoderCache`, which follows the hypotheses the search keeps.

Scores follow fairseq: a finished hypothesis of n tokens (its </s> included) with summed log
probability L scores L / n**lenpen. lenpen = 1 ranks by the mean log probability per token, lenpen = 0
by the total (which favours short outputs); larger values favour longer outputs. A hypothesis gets at
most `max_len_a * source_length + max_len_b` tokens before its </s> (source length counts the source's
</s>); at that point </s> is forced. The defaults of these settings live in `EvalConfig`.
"""
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from transformer.specials import BOS, EOS, PAD

NEG_INF = -float("inf")


@dataclass
class Hypothesis:
    tokens: List[int]  # target ids, without <s> and </s>
    score: float  # logprob / length**lenpen (the ranking score)
    logprob: float  # summed log probability, the final </s> included when it was produced
    text: Optional[str] = None  # detokenised, filled in by `translate_sentences`
    positional: List[float] = field(default_factory=list)  # log probability of each token (+ </s>)


def max_lengths(src: torch.Tensor, a: float, b: int, cap: Optional[int] = None) -> torch.Tensor:
    """Per-sentence output limit a * source length + b (source length without padding), at most `cap`."""
    return ((src != PAD).sum(dim=1).float() * a + b).long().clamp(min=1, max=cap)  # (B,)


def next_logprobs(model, tokens: torch.Tensor, cache, stop_at_eos: bool) -> torch.Tensor:
    """Log probabilities of the next token for every row, (R, V) in fp32; <pad> and <s> never come next,
    nor </s> when `stop_at_eos` is False (every output then runs to its limit: speed measurements)."""
    logits = model.decode(tokens[:, -1:], cache=cache)[:, -1]  # (R, V)
    lprobs = F.log_softmax(logits.float(), dim=-1)
    banned = [PAD, BOS] if stop_at_eos else [PAD, BOS, EOS]
    return lprobs.index_fill_(1, torch.tensor(banned, device=lprobs.device), NEG_INF)  # one pass, not one each


class eval_mode:
    """Eval mode (no dropout) inside, the caller's mode restored after (validation runs mid-training)."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


@torch.no_grad()
def greedy_search(model, src: torch.Tensor, lenpen: float, max_len_a: float, max_len_b: int,
                  stop_at_eos: bool = True, max_len: Optional[int] = None) -> List[Hypothesis]:
    """src (B, S) -> the most probable next token at each step, one Hypothesis per sentence.
    A sentence stops at </s> or at its length limit (never beyond `max_len` tokens)."""
    with eval_mode(model):
        B, device = src.size(0), src.device
        memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        cache = model.new_cache(memory, src_mask)
        limits = max_lengths(src, max_len_a, max_len_b, max_len)  # (R,) of the live rows
        alive = torch.arange(B, device=device)  # original index of each row
        tokens = torch.full((B, 1), BOS, dtype=torch.long, device=device)  # (R, t+1)
        logps = torch.zeros(B, 0, device=device)  # (R, t)
        results: List[Optional[Hypothesis]] = [None] * B
        for t in range(int(limits.max())):
            logp, nxt = next_logprobs(model, tokens, cache, stop_at_eos).max(dim=-1)  # (R,)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            logps = torch.cat([logps, logp[:, None]], dim=1)
            done = (nxt == EOS) | (t + 1 >= limits)
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
            alive, tokens, logps, limits = alive[keep], tokens[keep], logps[keep], limits[keep]
            cache.reorder(keep)
        return results


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, max_len_a: float, max_len_b: int) -> List[List[int]]:
    """src (B, S) -> one token list per sentence, without <s>/</s>. A sentence stops at </s> or its limit."""
    return [h.tokens for h in greedy_search(model, src, 1.0, max_len_a, max_len_b)]


class _Beams:
    """The live state of a beam search over R sentences with K rows each (R*K rows in all)."""

    def __init__(self, B: int, K: int, device):
        self.K = K
        self.alive = torch.arange(B, device=device)  # original index of each live sentence
        self.tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=device)  # (R*K, t+1)
        self.logps = torch.zeros(B * K, 0, device=device)  # (R*K, t) per-token log probabilities
        # Only the first copy of each sentence is live at step 0, so the K beams start out different.
        self.scores = torch.full((B, K), NEG_INF, device=device)  # (R, K)
        self.scores[:, 0] = 0.0
        self.finished: List[List[Hypothesis]] = [[] for _ in range(B)]


def _force_eos_at_limit(lprobs: torch.Tensor, at_limit: torch.Tensor) -> None:
    """Rows at their length limit may only end: </s> keeps its log probability (0 if it had none)."""
    if bool(at_limit.any()):
        eos = lprobs[at_limit, EOS]
        lprobs[at_limit] = NEG_INF
        lprobs[at_limit, EOS] = torch.where(torch.isfinite(eos), eos, torch.zeros_like(eos))


def _finish(beams: _Beams, lprobs, top, src_beam, is_eos, t: int, lenpen: float) -> torch.Tensor:
    """Moves the candidates ending in </s> among each sentence's top K into its finished list; returns
    (R,) True for the sentences that now have K finished hypotheses."""
    K = beams.K
    done = torch.zeros(top.size(0), dtype=torch.bool, device=top.device)
    if not bool(is_eos[:, :K].any()):
        return done
    for r, j in is_eos[:, :K].nonzero().tolist():
        finished = beams.finished[int(beams.alive[r])]
        if len(finished) >= K:
            continue
        row = r * K + int(src_beam[r, j])
        lp = beams.logps[row].tolist() + [float(lprobs[row, EOS])]
        total = float(top[r, j])
        finished.append(Hypothesis(beams.tokens[row, 1:].tolist(), total / (t + 1) ** lenpen, total, positional=lp))
        done[r] = len(finished) >= K
    return done


def _advance(beams: _Beams, lprobs, top, idx, tok, src_beam, is_eos) -> torch.Tensor:
    """The K best candidates not ending in </s> continue; returns each new row's parent row (R*K,)."""
    K, R = beams.K, top.size(0)
    order = is_eos.long() * idx.size(1) + torch.arange(idx.size(1), device=idx.device)  # </s> candidates last
    active = order.topk(K, dim=1, largest=False).indices  # (R, K)
    beams.scores = top.gather(1, active)
    new_tok = tok.gather(1, active).view(-1)
    parent = (torch.arange(R, device=idx.device)[:, None] * K + src_beam.gather(1, active)).view(-1)
    beams.tokens = torch.cat([beams.tokens[parent], new_tok[:, None]], dim=1)
    beams.logps = torch.cat([beams.logps[parent], lprobs[parent, new_tok][:, None]], dim=1)
    return parent


def _drop_done(beams: _Beams, done: torch.Tensor, parent: torch.Tensor):
    """Removes finished sentences; returns (parent rows of the remaining rows, the rows kept or None)."""
    if not bool(done.any()):
        return parent, None
    keep = (~done).nonzero().flatten()
    keep_rows = (keep[:, None] * beams.K + torch.arange(beams.K, device=keep.device)).view(-1)
    beams.alive, beams.scores = beams.alive[keep], beams.scores[keep]
    beams.tokens, beams.logps = beams.tokens[keep_rows], beams.logps[keep_rows]
    return parent[keep_rows], keep_rows


@torch.no_grad()
def beam_search(model, src: torch.Tensor, beam: int, lenpen: float, max_len_a: float, max_len_b: int,
                nbest: int = 1, stop_at_eos: bool = True, max_len: Optional[int] = None) -> List[List[Hypothesis]]:
    """Beam search (paper Section 6.1), batched over sentences, on the key/value-cached decoder.

    fairseq's procedure: every step takes the 2*beam best extensions of the sentence's beam; those
    ending in </s> among the top `beam` are finished, the best `beam` others continue. A sentence is
    done once it has `beam` finished hypotheses (at the length limit all of its live ones finish).

    Args:
        model: a Transformer (`encode`, `new_cache`, `decode`); run in eval mode, its mode restored after.
        src: (B, S) source token ids, right-padded with PAD.
        beam: K, the hypotheses kept per sentence; the cache holds B*K rows.
        lenpen: length penalty: a finished hypothesis of n tokens scores logprob / n**lenpen.
        max_len_a, max_len_b: a hypothesis gets at most max_len_a * source length + max_len_b tokens
            before its </s>, which is then forced.
        nbest: hypotheses returned per sentence (at most `beam`).
        stop_at_eos: False forbids </s>, so every output runs to its limit (speed measurements).
        max_len: a cap on every sentence's limit.

    Returns:
        B lists (in the order of `src`) of up to `nbest` Hypothesis, best score first; a sentence that
        finished nothing gets one empty hypothesis of score -inf.
    """
    with eval_mode(model):
        B, K, device = src.size(0), beam, src.device
        memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        # The encoder output's keys/values are projected once per sentence, then copied to its K rows.
        cache = model.new_cache(memory, src_mask)
        cache.reorder(torch.arange(B, device=device).repeat_interleave(K))  # (B*K,) each sentence K times
        limits = max_lengths(src, max_len_a, max_len_b, max_len)  # (B,)
        beams = _Beams(B, K, device)
        for t in range(int(limits.max()) + 1):
            R = beams.alive.numel()
            lprobs = next_logprobs(model, beams.tokens, cache, stop_at_eos)  # (R*K, V)
            V = lprobs.size(1)
            _force_eos_at_limit(lprobs, (t >= limits[beams.alive]).repeat_interleave(K))
            cand = (beams.scores.view(R * K, 1) + lprobs).view(R, K * V)
            top, idx = cand.topk(min(2 * K, K * V), dim=1)  # (R, 2K)
            src_beam, tok = idx // V, idx % V
            is_eos = (tok == EOS) & torch.isfinite(top)
            done = _finish(beams, lprobs, top, src_beam, is_eos, t, lenpen)
            parent = _advance(beams, lprobs, top, idx, tok, src_beam, is_eos)
            done |= ~torch.isfinite(beams.scores).any(dim=1)  # nothing live left (tiny vocabularies)
            if bool(done.all()):
                break
            parent, keep_rows = _drop_done(beams, done, parent)
            cache.reorder(parent, keep_rows, same_sources=True)
        # A sentence with nothing finished (only possible with a vocabulary of specials) gets an empty output.
        return [sorted(hyps, key=lambda h: -h.score)[:nbest] or [Hypothesis([], NEG_INF, NEG_INF)]
                for hyps in beams.finished]


def search(model, src: torch.Tensor, ev, stop_at_eos: bool = True,
           max_len: Optional[int] = None) -> List[List[Hypothesis]]:
    """Greedy search when ev.beam == 1 (and ev.nbest == 1), else beam search; `ev` is an EvalConfig (a
    DictConfig of one works too). Outputs get at most `max_len` tokens. Returns each sentence's n-best list."""
    if ev.beam == 1 and ev.nbest == 1:
        return [[h] for h in greedy_search(model, src, ev.lenpen, ev.max_len_a, ev.max_len_b, stop_at_eos, max_len)]
    return beam_search(model, src, ev.beam, ev.lenpen, ev.max_len_a, ev.max_len_b, ev.nbest, stop_at_eos, max_len)
