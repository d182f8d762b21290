"""TokenBatchSampler and collate: coverage, sharding, token budget, resumption, determinism."""
import numpy as np
import pytest
import torch

from transformer.data import batch as batch_module
from transformer.data.batch import BOS, EOS, PAD, PairDataset, Ragged, collate
from transformer.data.module import DataModule
from transformer.data.sampler import TokenBatchSampler


def _sizes(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(2, 60, n)
    tgt = np.clip(src + rng.integers(-8, 9, n), 2, 70)
    return src, tgt


def _cost(batch, src, tgt):
    return len(batch) * int(max(src[batch].max(), tgt[batch].max()))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("max_sentences", [None, 7])
def test_every_example_once_per_epoch_across_ranks(world_size, max_sentences):
    src, tgt = _sizes()
    samplers = [TokenBatchSampler(src, tgt, 500, max_sentences, seed=3, rank=r, world_size=world_size)
                for r in range(world_size)]
    for epoch in (0, 1):
        per_rank = [s.rank_batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1  # equal batch counts: no rank waits at the epoch end
        assert all(s.num_batches(epoch) == len(per_rank[0]) for s in samplers)
        seen = np.concatenate([b for batches in per_rank for b in batches])
        assert sorted(seen.tolist()) == list(range(len(src)))
        for batches in per_rank:
            for b in batches:
                assert len(b) > 0 and _cost(b, src, tgt) <= 500
                assert max_sentences is None or len(b) <= max_sentences


def test_ranks_interleave_one_global_batch_list():
    src, tgt = _sizes()
    full = TokenBatchSampler(src, tgt, 400, seed=5, world_size=2).epoch_batches(0)
    r0 = TokenBatchSampler(src, tgt, 400, seed=5, rank=0, world_size=2).rank_batches(0)
    r1 = TokenBatchSampler(src, tgt, 400, seed=5, rank=1, world_size=2).rank_batches(0)
    assert all(np.array_equal(a, b) for a, b in zip(full[0::2], r0, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(full[1::2], r1, strict=True))


def test_resume_yields_the_identical_remaining_batches():
    src, tgt = _sizes()
    for rank in (0, 1):
        whole = TokenBatchSampler(src, tgt, 300, seed=1, rank=rank, world_size=2).rank_batches(4)
        resumed = TokenBatchSampler(src, tgt, 300, seed=1, rank=rank, world_size=2).rank_batches(4, start=5)
        assert len(resumed) == len(whole) - 5
        assert all(np.array_equal(a, b) for a, b in zip(whole[5:], resumed, strict=True))


def test_deterministic_given_seed_epoch_world_size():
    src, tgt = _sizes()

    def batches(seed, epoch, world_size):
        sampler = TokenBatchSampler(src, tgt, 300, seed=seed, world_size=world_size)
        return [b.tolist() for b in sampler.epoch_batches(epoch)]

    assert batches(1, 2, 2) == batches(1, 2, 2)
    assert batches(1, 2, 2) != batches(1, 3, 2)  # a new order every epoch
    assert batches(1, 2, 2) != batches(2, 2, 2)


def test_batches_group_similar_lengths():
    src, tgt = _sizes(5000)
    batches = TokenBatchSampler(src, tgt, 2000, seed=0).epoch_batches(0)
    padded = sum(len(b) * (src[b].max() + tgt[b].max()) for b in batches)
    assert 1 - (src.sum() + tgt.sum()) / padded < 0.2


def test_validation_order_is_fixed():
    src, tgt = _sizes()
    s = TokenBatchSampler(src, tgt, 300, seed=1, shuffle=False)
    assert [b.tolist() for b in s.epoch_batches(0)] == [b.tolist() for b in s.epoch_batches(7)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_batches_grow_by_epoch(world_size):
    """max_tokens_by_epoch=[300, 300, 600] with max_tokens=900: epochs 0-1 are planned exactly as with
    max_tokens=300, epoch 2 as with 600 (half as many batches, each within 600 tokens, every example still
    once), and every later epoch with max_tokens itself."""
    src, tgt = _sizes()
    grow = [TokenBatchSampler(src, tgt, 900, seed=5, rank=r, world_size=world_size,
                              max_tokens_by_epoch=[300, 300, 600]) for r in range(world_size)]
    small, big, last = (TokenBatchSampler(src, tgt, n, seed=5, world_size=world_size) for n in (300, 600, 900))
    for epoch, same in ((0, small), (1, small), (2, big), (3, last), (5, last)):
        assert [b.tolist() for b in grow[0].epoch_batches(epoch)] == [b.tolist() for b in same.epoch_batches(epoch)]
        assert grow[0].num_batches(epoch) == same.num_batches(epoch)
        ids = np.concatenate([b for g in grow for b in g.rank_batches(epoch)])
        assert sorted(ids.tolist()) == list(range(len(src)))
    assert max(_cost(b, src, tgt) for b in grow[0].epoch_batches(2)) > 300
    assert grow[0].num_batches(2) < 0.6 * grow[0].num_batches(1)


def test_errors():
    src, tgt = _sizes(10)
    with pytest.raises(ValueError, match="data.max_tokens=50 is smaller than the longest example"):
        TokenBatchSampler(src, tgt + 60, 50)
    with pytest.raises(ValueError, match=r"data.max_tokens_by_epoch entry 50 is smaller than the longest example"):
        TokenBatchSampler(src, tgt + 60, 500, max_tokens_by_epoch=[200, 50])
    with pytest.raises(ValueError, match=r"data.max_tokens=50 is smaller than the longest example"):
        TokenBatchSampler(src, tgt + 60, 50, max_tokens_by_epoch=[200])
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        TokenBatchSampler(src, tgt, 500, rank=2, world_size=2)
    with pytest.raises(ValueError, match="10 examples cannot be shared by 11 workers"):
        TokenBatchSampler(src, tgt, 500, world_size=11)


def test_collate_frames_source_and_target():
    items = [(7, np.array([5, 6, 7], dtype=np.int32), np.array([8], dtype=np.int32)),
             (2, np.array([9], dtype=np.int32), np.array([10, 11, 12], dtype=np.int32))]
    b = collate(items)
    assert b.src.tolist() == [[5, 6, 7, EOS], [9, EOS, PAD, PAD]]
    assert b.tgt_in.tolist() == [[BOS, 8, PAD, PAD], [BOS, 10, 11, 12]]
    assert b.tgt_out.tolist() == [[8, EOS, PAD, PAD], [10, 11, 12, EOS]]
    assert b.ids.tolist() == [7, 2] and b.n_tokens == 6 and len(b) == 2


def test_a_batch_travels_as_one_buffer():
    """collate's four tensors are views of one buffer: a loader worker sends one buffer, the
    pin-memory thread pins it once and `Batch.to` copies it in one transfer; the moved views hold the same
    values. A batch of separate tensors (padded on the device, built by hand) moves tensor by tensor."""
    items = [(7, np.array([5, 6, 7], dtype=np.int32), np.array([8], dtype=np.int32)),
             (2, np.array([9], dtype=np.int32), np.array([10, 11, 12], dtype=np.int32))]
    b = collate(items)
    tensors = (b.src, b.tgt_in, b.tgt_out, b.ids)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    copies = []

    def copy(t):  # a stand-in for the move to pinned memory or to a device
        copies.append(t.numel())
        return t.clone()

    moved = batch_module._moved(tensors, copy)
    assert copies == [b.src.numel() + 2 * b.tgt_in.numel() + b.ids.numel()]  # one copy of the whole buffer
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1
    assert moved[0].untyped_storage().data_ptr() != b.src.untyped_storage().data_ptr()
    assert all(torch.equal(m, t) and m.shape == t.shape for m, t in zip(moved, tensors, strict=True))
    assert batch_module._moved(tensors, lambda t: t) == list(tensors)  # nothing moved: the same tensors
    copies.clear()
    apart = (b.src.clone(), b.tgt_in.clone(), b.tgt_out.clone())
    assert all(torch.equal(m, t) for m, t in zip(batch_module._moved(apart, copy), apart, strict=True))
    assert copies == [t.numel() for t in apart]
    assert b.to(torch.device("cpu")).src is b.src


@pytest.mark.parametrize("rows", [2, 3000])
def test_a_small_batch_crosses_the_workers_pipe_as_bytes_and_a_large_one_in_shared_memory(rows):
    """What a loader worker sends (multiprocessing's ForkingPickler): a small batch's buffer as bytes in the pickle
    itself (no shared-memory file descriptor to receive), the same views of one buffer coming out; above
    IN_BAND_BYTES the tensors go by shared memory, as torch pickles them between processes."""
    import pickle
    from multiprocessing.reduction import ForkingPickler
    rng = np.random.default_rng(0)
    items = [(i, rng.integers(4, 50, size=rng.integers(1, 30)).astype(np.int32),
              rng.integers(4, 50, size=rng.integers(1, 30)).astype(np.int32)) for i in range(rows)]
    b = collate(items, packed=True)
    nbytes = b.src.untyped_storage().nbytes()
    small = nbytes <= batch_module.IN_BAND_BYTES
    assert small == (rows == 2)
    payload = ForkingPickler.dumps(b)
    got = pickle.loads(payload)
    assert (len(payload) > nbytes) == small  # the buffer itself is in the pickle, or only a handle to it
    assert got.src.is_shared() != small
    tensors = (got.src, got.tgt_in, got.tgt_out, got.ids)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # still one buffer: pinned once
    for mine, theirs in zip(tensors, (b.src, b.tgt_in, b.tgt_out, b.ids), strict=True):
        assert torch.equal(mine, theirs) and mine.stride() == theirs.stride()
    assert got.n_tokens == b.n_tokens and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y
        for p, q in zip(got.packings, b.packings, strict=True) for x, y in zip(p, q, strict=True))


def test_a_loader_worker_hands_over_one_storage_a_batch():
    rng = np.random.default_rng(0)
    seqs = Ragged.from_lists([rng.integers(4, 20, rng.integers(1, 12)).tolist() for _ in range(60)])
    data = PairDataset(seqs, seqs)
    dm = DataModule(data, data, _Tok(), max_tokens=60, max_sentences=None, seed=0, rank=0, world_size=1,
                    num_workers=1)
    batches = list(dm.train_loader(0))
    assert len(batches) > 3
    assert all(len({t.untyped_storage().data_ptr() for t in (b.src, b.tgt_in, b.tgt_out, b.ids)}) == 1
               for b in batches)


class _Tok:
    src_vocab_size = tgt_vocab_size = 20
    shared_vocab = True


def test_datamodule_loaders_cover_the_split_and_resume():
    rng = np.random.default_rng(0)
    seqs = Ragged.from_lists([rng.integers(4, 20, rng.integers(1, 12)).tolist() for _ in range(200)])
    data = PairDataset(seqs, seqs)
    dms = [DataModule(data, data, _Tok(), max_tokens=60, max_sentences=None, seed=0, rank=r, world_size=2)
           for r in range(2)]
    ids = [i for dm in dms for batch in dm.train_loader(1) for i in batch.ids.tolist()]
    assert sorted(ids) == list(range(200))
    whole = [batch.ids.tolist() for batch in dms[1].train_loader(1)]
    assert [batch.ids.tolist() for batch in dms[1].train_loader(1, start=3)] == whole[3:]
    assert len(whole) == dms[1].num_train_batches(1)
    for batch in dms[0].train_loader(1):
        assert batch.src.numel() <= 60 and batch.tgt_in.numel() <= 60
        assert torch.equal((batch.src == EOS).sum(1), torch.ones(len(batch), dtype=torch.long))
    valid = sorted(i for dm in dms for batch in dm.valid_loader() for i in batch.ids.tolist())
    assert valid == list(range(200))


def _loop_batches(src, tgt, max_tokens, max_sentences, seed, epoch, world_size, shuffle=True):
    """The sampler's first implementation (a Python loop over examples), kept as the reference the
    vectorised one must reproduce batch for batch."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(src)) if shuffle else np.arange(len(src))
    size = np.maximum(src, tgt)
    order = order[np.lexsort((src[order], tgt[order], size[order]))]
    batches, start, max_sentences = [], 0, max_sentences or len(src)
    for i, longest in enumerate(size[order].tolist()):
        n = i - start + 1
        if n > max_sentences or n * longest > max_tokens:
            batches.append(order[start:i])
            start = i
    batches.append(order[start:])
    batches = TokenBatchSampler(src, tgt, max_tokens, world_size=world_size)._split_to_multiple(batches)
    return [batches[j] for j in rng.permutation(len(batches))] if shuffle else batches


@pytest.mark.parametrize("max_tokens,max_sentences,world_size,shuffle",
                         [(500, None, 1, True), (300, 7, 3, True), (2000, 64, 2, True), (71, None, 2, False)])
def test_vectorised_plan_equals_the_loop(max_tokens, max_sentences, world_size, shuffle):
    src, tgt = _sizes(3000, seed=4)
    for epoch in (0, 5):
        ours = TokenBatchSampler(src, tgt, max_tokens, max_sentences, seed=9, world_size=world_size,
                                 shuffle=shuffle).epoch_batches(epoch)
        ref = _loop_batches(src, tgt, max_tokens, max_sentences, 9, epoch, world_size, shuffle)
        assert len(ours) == len(ref) and all(np.array_equal(a, b) for a, b in zip(ours, ref, strict=False))


def test_memory_mapped_dataset_pickles_as_paths(tmp_path):
    """DataLoader workers started by spawn unpickle the dataset: they must map the files, not copy them."""
    import pickle

    from transformer.data.store import RaggedWriter
    w = RaggedWriter(tmp_path, "train", "src", np.uint16)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 5000)
    w.append(rng.integers(4, 60000, int(lengths.sum())), lengths)
    w.close()
    r = Ragged.open(tmp_path / "train.src.tokens.npy", tmp_path / "train.src.offsets.npy")
    assert isinstance(r.data, np.memmap) and r.data.dtype == np.uint16 and len(r) == 5000
    data = PairDataset(r, r)
    blob = pickle.dumps(data)
    assert len(blob) < 2000 < r.data.nbytes
    again = pickle.loads(blob)
    assert isinstance(again.src.data, np.memmap)
    assert all(np.array_equal(again[i][1], data[i][1]) for i in (0, 17, 4999))
    plain = Ragged.from_lists([[4, 5], [6]])
    assert pickle.loads(pickle.dumps(plain))[0].tolist() == [4, 5]  # in-memory arrays still pickle by value


def test_loader_workers_persist_across_epochs_and_take_the_same_batches():
    """With workers, one DataLoader serves every epoch (its workers start once); each epoch, and a resumed
    epoch's remainder, yields exactly the batches of the worker-less loader, also after an epoch left unfinished."""
    rng = np.random.default_rng(0)
    seqs = Ragged.from_lists([rng.integers(4, 20, rng.integers(1, 12)).tolist() for _ in range(200)])
    data = PairDataset(seqs, seqs)
    plain, workers = (DataModule(data, data, _Tok(), max_tokens=60, max_sentences=None, seed=0, rank=0,
                                 world_size=1, num_workers=n) for n in (0, 1))
    try:
        def ids(loader, n=None):
            it = iter(loader)
            return [next(it).ids.tolist() for _ in range(n)] if n else [b.ids.tolist() for b in it]

        first = workers.train_loader(0)
        assert ids(first, 2) == ids(plain.train_loader(0), 2)  # left unfinished: its prefetched batches dropped
        pids = [w.pid for w in first._iterator._workers]
        for epoch, start in ((1, 0), (2, 5), (0, 0)):
            loader = workers.train_loader(epoch, start)
            assert loader is first and ids(loader) == ids(plain.train_loader(epoch, start))
            assert [w.pid for w in loader._iterator._workers] == pids  # not restarted
        assert sorted(i for b in ids(workers.train_loader(3)) for i in b) == list(range(200))
    finally:
        workers.close()
    assert workers._persistent is None
