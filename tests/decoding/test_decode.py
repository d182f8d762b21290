"""Greedy and beam search: equivalences (beam 1 = greedy, cached = uncached, batch = one by one),
</s> handling, length limits and the length penalty."""
import math

import numpy as np
import pytest
import torch

from tests.helpers.decoding import Uncached, beam, greedy
from tests.helpers.models import VOCAB, copy_model, one_thread, random_copy_items  # noqa: F401 (fixture)
from transformer.config import EvalConfig, ModelConfig
from transformer.data.batch import BOS, EOS, PAD, collate
from transformer.data.copy import CopyTokenizer
from transformer.decoding import encode_batch, length_batches, search, translate_sentences
from transformer.decoding.search import max_lengths
from transformer.model import Transformer


class ScriptedModel(torch.nn.Module):
    """A stand-in decoder whose next-token distribution depends only on the previous token, given as a
    table {previous token: {next token: probability}}; unlisted pairs get probability 0 (rows not in the
    table are uniform)."""

    class Cache:
        def __init__(self, src_mask):
            self.src_mask = src_mask

        def reorder(self, rows, source_rows=None, same_sources=False):
            rows = source_rows if same_sources else rows
            if rows is not None:
                self.src_mask = self.src_mask.index_select(0, rows)

    def __init__(self, table: dict, vocab: int = 8):
        super().__init__()
        logits = torch.zeros(vocab, vocab)
        for prev, nxt in table.items():
            logits[prev] = -float("inf")
            for tok, p in nxt.items():
                logits[prev, tok] = math.log(p)
        self.register_buffer("logits", logits)

    def encode(self, src):
        return torch.zeros(src.size(0), src.size(1), 1), (src != PAD)[:, None, None, :]

    def new_cache(self, memory, src_mask):
        return self.Cache(src_mask)

    def decode(self, tgt_in, memory=None, src_mask=None, cache=None):
        return self.logits[tgt_in]  # (B, T, V)


A, B_, C, D = 4, 5, 6, 7


@pytest.fixture(scope="module")
def model():
    return copy_model()


@pytest.fixture(scope="module")
def src():
    items = random_copy_items(24, seed=1000)
    return collate(items).src


def test_copy_model_learned_the_task(model, src):
    # Guards the other tests: they compare decoders on a model that emits </s> at sensible places.
    hyps = greedy(model, src)
    refs = [s[s > EOS].tolist() for s in src]
    assert np.mean([h == r for h, r in zip(hyps, refs, strict=False)]) >= 0.75


def test_beam_size_one_is_greedy(model, src):
    expected = greedy(model, src)
    assert [n[0].tokens for n in beam(model, src, beam=1)] == expected
    torch.manual_seed(3)
    untrained = Transformer.from_config(ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0), VOCAB, VOCAB).eval()
    assert [n[0].tokens for n in beam(untrained, src, beam=1)] == greedy(untrained, src)


@pytest.mark.parametrize("size", [1, 4])
def test_cached_equals_uncached(model, src, size):
    cached = search(model, src, EvalConfig(beam=size, nbest=size))
    uncached = search(Uncached(model), src, EvalConfig(beam=size, nbest=size))
    assert [[h.tokens for h in n] for n in cached] == [[h.tokens for h in n] for n in uncached]
    for n1, n2 in zip(cached, uncached, strict=False):
        for h1, h2 in zip(n1, n2, strict=False):
            assert h1.score == pytest.approx(h2.score, abs=1e-4)


def test_batch_equals_one_by_one(model, src):
    for cfg in (EvalConfig(beam=1), EvalConfig(beam=4, nbest=2)):
        batched = [[h.tokens for h in n] for n in search(model, src, cfg)]
        # Each sentence alone, without the padding its batch gave it.
        single = [[h.tokens for h in search(model, s[s != PAD][None], cfg)[0]] for s in src]
        assert batched == single


def test_eos_stops_a_hypothesis_and_limits_hold():
    # After A, </s> is certain: every search stops there.
    m = ScriptedModel({BOS: {A: 1.0}, A: {EOS: 0.9, B_: 0.1}, B_: {B_: 1.0}})
    src = torch.tensor([[A, A, EOS]])
    assert greedy(m, src) == [[A]]
    nbest = beam(m, src, beam=2, nbest=2)[0]
    assert nbest[0].tokens == [A]
    limit = int(max_lengths(src, 1.2, 10)[0])
    # The other hypothesis never meets </s> and ends at the length limit.
    assert nbest[1].tokens == [A] + [B_] * (limit - 1)
    # With </s> banned, the output has exactly the limit's length (used by the benchmark).
    assert len(greedy(m, src, stop_at_eos=False)[0]) == limit
    assert len(beam(m, src, beam=2, stop_at_eos=False)[0][0].tokens) == limit


def test_length_limit_is_a_times_source_length_plus_b(model):
    m = ScriptedModel({BOS: {A: 1.0}, A: {A: 1.0}})  # never ends on its own
    src = torch.tensor([[A, A, A, EOS], [A, EOS, PAD, PAD]])  # lengths 4 and 2 (with </s>)
    assert [len(h) for h in greedy(m, src, max_len_a=2.0, max_len_b=3)] == [11, 7]
    assert [len(n[0].tokens) for n in beam(m, src, beam=3, max_len_a=2.0, max_len_b=3)] == [11, 7]


def test_length_penalty_changes_the_ranking_as_documented():
    # "A </s>": log p = log .6 over 2 tokens; "B C D </s>": log p = log .4 over 4 tokens.
    m = ScriptedModel({BOS: {A: 0.6, B_: 0.4}, A: {EOS: 1.0}, B_: {C: 1.0}, C: {D: 1.0}, D: {EOS: 1.0}})
    src = torch.tensor([[A, EOS]])
    short, long = math.log(0.6), math.log(0.4)
    for lenpen, winner in ((0.0, [A]), (1.0, [B_, C, D])):
        nbest = beam(m, src, beam=2, nbest=2, lenpen=lenpen, max_len_a=0, max_len_b=10)[0]
        assert nbest[0].tokens == winner
        by_tokens = {tuple(h.tokens): h for h in nbest}
        assert by_tokens[(A,)].score == pytest.approx(short / 2 ** lenpen, rel=1e-5)
        assert by_tokens[(B_, C, D)].score == pytest.approx(long / 4 ** lenpen, rel=1e-5)
        assert by_tokens[(B_, C, D)].logprob == pytest.approx(long, rel=1e-5)


def test_nbest_is_sorted_and_distinct(model, src):
    for nbest in beam(model, src[:4], beam=5, nbest=5):
        assert len(nbest) == 5
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
        assert len({tuple(h.tokens) for h in nbest}) == 5
        for h in nbest:
            assert h.logprob == pytest.approx(sum(h.positional), abs=1e-4)


def test_greedy_search_keeps_training_mode(model):
    model.train()
    try:
        greedy(model, encode_batch([[4, 5]], "cpu"))
        assert model.training
    finally:
        model.eval()


def test_length_batches_cover_everything_within_the_budget():
    lengths = [5, 3, 9, 2, 7, 7, 1, 4]
    batches = length_batches(lengths, batch_tokens=16)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 16
    assert length_batches(lengths, batch_tokens=1) == [[i] for i in sorted(range(8), key=lambda i: -lengths[i])]


def test_translate_sentences_keeps_input_order_whatever_the_batching(model):
    tok = CopyTokenizer(VOCAB)
    sentences = [" ".join(str(t) for t in s) for _, s, _ in random_copy_items(30, seed=77)]
    big = translate_sentences(model, tok, sentences, EvalConfig(beam=3, batch_tokens=8000))
    small = translate_sentences(model, tok, sentences, EvalConfig(beam=3, batch_tokens=12))
    assert [n[0].text for n in big] == [n[0].text for n in small]
    direct = search(model, encode_batch([tok.encode_src(s) for s in sentences], "cpu"), EvalConfig(beam=3))
    assert [n[0].text for n in big] == [tok.decode_tgt(n[0].tokens) for n in direct]
    assert np.mean([n[0].text == s for n, s in zip(big, sentences, strict=False)]) >= 0.5  # it copies
