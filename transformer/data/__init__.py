"""Datasets: `build_data(cfg, env, run_dir)` returns the `DataModule` the trainer reads.

Names are imported on first use: preprocessing worker processes import `transformer.data.encode` and
must not pay for torch, which `batch` and `module` import."""
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformer.data.module import DataModule

_LAZY = {"BOS": "batch", "EOS": "batch", "PAD": "batch", "SPECIALS": "batch", "UNK": "batch", "Batch": "batch",
         "DataModule": "module"}
__all__ = [*_LAZY, "build_data"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"transformer.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'transformer.data' has no attribute {name!r}")


def build_data(cfg, env, run_dir: Optional[Path] = None, tokenizer_state: Optional[dict] = None) -> "DataModule":
    """`env` is the `transformer.dist.DistEnv` of this worker: rank 0 prepares shared files while the
    others wait at `env.barrier()`. `run_dir` (rank 0 only writes there) receives the tokenizer files.
    `tokenizer_state` (trainer.init_from's): translation data is encoded with it, not a newly learnt one."""
    name = cfg.data.name
    if name == "copy":
        from transformer.data.copy import CopyData
        return CopyData(cfg, cfg.seed, env.rank, env.world_size)
    if name in ("multi30k", "files", "wmt14") or cfg.data.preprocessed:
        from transformer.data.translation import build_translation_data
        return build_translation_data(cfg, env, run_dir, tokenizer_state)
    raise ValueError(f"data.name={name!r}: must be copy, multi30k, files or wmt14")
