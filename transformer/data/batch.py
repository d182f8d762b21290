"""Ragged token storage, the padded `Batch` the model consumes, and the collate function that makes it."""
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from transformer.experimental.varlen import Packing, host_packing
from transformer.specials import BOS, EOS, PAD, SPECIALS, UNK  # noqa: F401 (re-exported for the data package)


class Ragged:
    """Variable-length int sequences in one flat array plus offsets (cheap to store, map and slice).

    `Ragged.open` memory-maps a preprocessed folder's arrays (transformer/data/store.py); such a Ragged
    pickles as its two paths, so a DataLoader worker started by spawn maps the files too, never a copy."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets
        self.paths: Optional[Tuple[str, str]] = None

    @classmethod
    def open(cls, tokens: str, offsets: str) -> "Ragged":
        from transformer.data.store import open_ragged_arrays
        r = cls(*open_ragged_arrays(Path(tokens), Path(offsets)))
        r.paths = (str(tokens), str(offsets))
        return r

    def __reduce__(self):
        if self.paths is not None:
            return Ragged.open, self.paths
        return Ragged, (self.data, self.offsets)

    def close(self) -> None:
        """Drops the arrays (and with them any memory map)."""
        self.data = self.offsets = None

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]]) -> "Ragged":
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
        return cls(data, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))


class PairDataset(torch.utils.data.Dataset):
    """Source/target id sequences without specials; `sizes` count the special token each side gets."""

    def __init__(self, src: Ragged, tgt: Ragged):
        if len(src) != len(tgt):
            raise ValueError(f"{len(src)} source but {len(tgt)} target sequences")
        self.src, self.tgt = src, tgt

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> Tuple[int, np.ndarray, np.ndarray]:
        return i, self.src[i], self.tgt[i]

    def close(self) -> None:
        self.src.close()
        self.tgt.close()

    @property
    def src_sizes(self) -> np.ndarray:
        return self.src.lengths + 1  # + </s>

    @property
    def tgt_sizes(self) -> np.ndarray:
        return self.tgt.lengths + 1  # <s> + y as input, y + </s> as output


@dataclass
class Batch:
    """A padded batch; a packed one (transformer/experimental/packed.py) has src (N_s,) and tgt_in/tgt_out (N_t,)
    instead,
    the sentences end to end, and always its packings."""
    src: torch.Tensor  # (B, S) x + </s>, right-padded with PAD
    tgt_in: torch.Tensor  # (B, T) <s> + y: the decoder input (teacher forcing)
    tgt_out: torch.Tensor  # (B, T) y + </s>: what the decoder must predict
    ids: torch.Tensor  # (B,) example indices in the split
    n_tokens: int  # non-pad target tokens: the loss is normalised by their sum over the step
    # (source, target) packings of the real tokens, made on the host by collate(packed=True), for the
    # unpadded forward (trainer.unpadded_attention): with them it reads no device value
    packings: Optional[Tuple[Packing, Packing]] = None

    def to(self, device: torch.device) -> "Batch":
        nb = device.type == "cuda"
        packings = None if self.packings is None else tuple(p.to(device, nb) for p in self.packings)
        src, tgt_in, tgt_out = _moved((self.src, self.tgt_in, self.tgt_out), lambda t: t.to(device, non_blocking=nb))
        return replace(self, src=src, tgt_in=tgt_in, tgt_out=tgt_out, packings=packings)

    def pin_memory(self) -> "Batch":
        # Called by the DataLoader's pin-memory thread; CUDA copies then overlap with compute.
        packings = None if self.packings is None else tuple(p.pin_memory() for p in self.packings)
        src, tgt_in, tgt_out, ids = _moved((self.src, self.tgt_in, self.tgt_out, self.ids), torch.Tensor.pin_memory)
        return replace(self, src=src, tgt_in=tgt_in, tgt_out=tgt_out, ids=ids, packings=packings)

    def __len__(self) -> int:
        return self.ids.size(0)  # sentences, also of a packed batch (transformer/experimental/packed.py)

    def __reduce__(self):
        """How a DataLoader worker hands the batch to the main process. A small CPU batch whose tensors are views
        of one buffer (collate's) travels as bytes through the worker's pipe: a shared-memory storage costs the
        receiving side a socket connection for its file descriptor and a mapping per batch, most of a small
        batch's wait in `next()` (measured in docs/benchmarks/the-step.md, "The host"). Larger or other batches
        pickle their tensors as usual (shared memory between processes)."""
        tensors = (self.src, self.tgt_in, self.tgt_out, self.ids)
        flat = _one_buffer(tensors)
        if flat is None or flat.device.type != "cpu" or flat.nbytes > IN_BAND_BYTES:
            return Batch, (*tensors, self.n_tokens, self.packings)
        views = tuple((t.size(), t.stride(), t.storage_offset()) for t in tensors)
        return _from_bytes, (flat.numpy(), views, self.n_tokens, self.packings)


IN_BAND_BYTES = 1 << 17  # up to here a batch crosses the pipe as bytes; above, copying costs what mapping does


def _from_bytes(flat: np.ndarray, views: tuple, n_tokens: int, packings) -> Batch:
    buffer = torch.from_numpy(flat)  # the unpickled array: the batch's own memory, no copy
    return Batch(*(buffer.as_strided(*v) for v in views), n_tokens, packings)


def _one_buffer(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The whole storage the tensors are views of, as one flat tensor; None if they are not of one storage and
    dtype."""
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.dtype != tensors[0].dtype for t in tensors):
        return None
    return torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device).set_(storage)


def _moved(tensors: Sequence[torch.Tensor], move) -> List[torch.Tensor]:
    """`move` (a pinning, a copy to a device) applied to views of one storage as one move of that storage, the
    same views taken of the result; to each tensor otherwise. collate's batches are such views: a loader worker
    hands the main process one buffer instead of four (`Batch.__reduce__`), which is pinned once and copied to
    the GPU in one transfer (small batches spend a step's host time on these per-tensor costs)."""
    whole = _one_buffer(tensors)
    if whole is None:
        return [move(t) for t in tensors]
    flat = move(whole)
    if flat.data_ptr() == whole.data_ptr():  # nothing moved (a copy to where it already is)
        return list(tensors)
    return [flat.as_strided(t.size(), t.stride(), t.storage_offset()) for t in tensors]


def write_pair(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, x: np.ndarray, y: np.ndarray):
    """Writes one pair from the start of the 1-D views given: x + </s>, <s> + y (the decoder input), y + </s>."""
    src[:len(x)] = torch.from_numpy(x.astype(np.int64))
    src[len(x)] = EOS
    tgt_in[0] = BOS
    tgt_in[1:len(y) + 1] = torch.from_numpy(y.astype(np.int64))
    tgt_out[:len(y)] = tgt_in[1:len(y) + 1]
    tgt_out[len(y)] = EOS


def pair_lengths(items: List[Tuple[int, np.ndarray, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
    """Each pair's source (x + </s>) and target (<s> + y, or y + </s>) lengths."""
    src = np.fromiter((len(s) + 1 for _, s, _ in items), dtype=np.int64, count=len(items))
    tgt = np.fromiter((len(t) + 1 for _, _, t in items), dtype=np.int64, count=len(items))
    return src, tgt


def collate(items: List[Tuple[int, np.ndarray, np.ndarray]], packed: bool = False) -> Batch:
    """CPU tensors only: CUDA tensors made in DataLoader workers would break fork and pinning. The four tensors
    are views of one buffer (`_moved`). `packed`: attach the packings of source and target (`Batch.packings`),
    computed here from the lengths."""
    B = len(items)
    S = max(len(s) for _, s, _ in items) + 1
    T = max(len(t) for _, _, t in items) + 1
    flat = torch.full((B * (S + 2 * T + 1),), PAD, dtype=torch.long)
    src, tgt_in, tgt_out, ids = flat.split([B * S, B * T, B * T, B])
    src, tgt_in, tgt_out = src.view(B, S), tgt_in.view(B, T), tgt_out.view(B, T)
    for b, (_, s, t) in enumerate(items):
        write_pair(src[b], tgt_in[b], tgt_out[b], s, t)
    ids.copy_(torch.tensor([i for i, _, _ in items], dtype=torch.long))
    packings = None
    if packed:
        src_lens, tgt_lens = pair_lengths(items)
        packings = (host_packing(src_lens, S), host_packing(tgt_lens, T))
    return Batch(src, tgt_in, tgt_out, ids, int((tgt_out != PAD).sum()), packings)


def packed_collate(items: List[Tuple[int, np.ndarray, np.ndarray]]) -> Batch:
    """`collate(items, packed=True)`, picklable for DataLoader workers started by spawn."""
    return collate(items, packed=True)
