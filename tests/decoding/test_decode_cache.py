"""The preallocated key/value cache (transformer/model/cache.py) against the cache it replaced: the same greedy
ids and beam hypotheses on a seeded model, and the beam's reorder moving keys/values as a full copy would."""
import pytest
import torch

from tests.helpers.decoding import beam, greedy
from transformer.config import ModelConfig
from transformer.data.batch import EOS, PAD
from transformer.model import Transformer
from transformer.model.cache import FIRST_CAPACITY, DecoderCache

VOCAB = 40


class CatLayerCache:
    """Before 2026-12-02: each step's keys/values appended with torch.cat (the whole prefix copied)."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class CatCache(DecoderCache):
    """The old algorithm: torch.cat growth, every row's keys/values copied by every reorder."""

    def __init__(self, cross_kv, src_mask):
        super().__init__(cross_kv, src_mask)
        self.self_attn = [CatLayerCache() for _ in range(cross_kv.size(0))]

    def extend(self, T):
        pass

    def reorder(self, rows, source_rows=None, same_sources=False):
        for layer in self.self_attn:
            if layer.k is not None:
                layer.k, layer.v = layer.k.index_select(0, rows), layer.v.index_select(0, rows)
        rows = source_rows if same_sources else rows
        if rows is not None:
            self.memory_kv, self.src_mask = self.memory_kv.index_select(0, rows), self.src_mask.index_select(0, rows)


class OldDecoder(torch.nn.Module):
    """`model` decoded with `CatCache`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, memory, src_mask):
        return CatCache(self.model.project_memory(memory), src_mask)

    def decode(self, tgt_in, cache):
        return self.model.decode(tgt_in, cache=cache)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(7)
    m = Transformer.from_config(ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0), VOCAB, VOCAB).eval()
    with torch.no_grad():  # </s> likelier than the rest, so that sentences end at different steps
        m.generator.weight[EOS] *= 3
    return m


@pytest.fixture(scope="module")
def src():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 12, (24,), generator=g)
    s = torch.full((24, 12), PAD)
    for i, n in enumerate(lengths.tolist()):
        s[i, :n] = torch.randint(4, VOCAB, (n,), generator=g)
        s[i, n] = EOS
    return s


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_greedy_ids_equal_the_old_cache(model, src, stop_at_eos):
    # max_len_b=40 runs past the buffer's first capacity, so it grows too.
    settings = {"max_len_a": 1.0, "max_len_b": 40, "stop_at_eos": stop_at_eos}
    new = greedy(model, src, **settings)
    assert new == greedy(OldDecoder(model), src, **settings)
    assert max(map(len, new)) > FIRST_CAPACITY
    if stop_at_eos:  # sentences left the batch at different steps: the compaction ran
        assert len({len(x) for x in new}) > 3


@pytest.mark.parametrize("size", [2, 5])
def test_beam_hypotheses_equal_the_old_cache(model, src, size):
    new, old = beam(model, src, size, nbest=size), beam(OldDecoder(model), src, size, nbest=size)
    assert [[h.tokens for h in n] for n in new] == [[h.tokens for h in n] for n in old]
    assert [h.score for n in new for h in n] == pytest.approx([h.score for n in old for h in n], abs=1e-5)


def test_reorder_within_sentences_moves_keys_values_as_a_copy_would():
    g = torch.Generator().manual_seed(0)
    B, K, h, S, d_k = 3, 4, 2, 5, 3
    cache = DecoderCache(torch.zeros(2, 2, B * K, h, S, d_k), torch.zeros(B * K, 1, 1, S))
    for layer in cache.self_attn:  # three positions
        cache.extend(3)
        layer.append(torch.randn(B * K, h, 3, d_k, generator=g), torch.randn(B * K, h, 3, d_k, generator=g))
    cache.advance(3)

    def logical():  # (R, N_dec, 2, h, t, d_k) in the search's row order
        kv = cache.kv[..., :cache.length, :]
        return kv if cache.slots is None else kv.index_select(0, cache.slots)

    for _ in range(6):
        parent = (torch.arange(B)[:, None] * K + torch.randint(0, K, (B, K), generator=g)).view(-1)
        expected = logical().index_select(0, parent)
        cache.reorder(parent, None, same_sources=True)
        assert torch.equal(logical(), expected)
        assert cache.slots is not None and torch.equal(cache.order.index_select(0, cache.slots), torch.arange(B * K))
    kept = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])  # the second sentence leaves
    expected = logical().index_select(0, kept)
    cache.reorder(kept, torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]), same_sources=True)
    assert cache.slots is None and torch.equal(logical(), expected) and cache.cross_kv.size(2) == 8
