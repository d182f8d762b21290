"""Datasets: `build_data(cfg, env, run_dir)` returns the `DataModule` the trainer reads."""
from pathlib import Path
from typing import Optional

from transformer.data.batch import BOS, EOS, PAD, SPECIALS, UNK, Batch
from transformer.data.module import DataModule

__all__ = ["BOS", "EOS", "PAD", "SPECIALS", "UNK", "Batch", "DataModule", "build_data"]


def build_data(cfg, env, run_dir: Optional[Path] = None) -> DataModule:
    """`env` is the `transformer.dist.DistEnv` of this worker: rank 0 prepares shared files while the
    others wait at `env.barrier()`. `run_dir` (rank 0 only writes there) receives the tokenizer files."""
    name = cfg.data.name
    if name == "copy":
        from transformer.data.copy import CopyData
        return CopyData(cfg, cfg.seed, env.rank, env.world_size)
    if name in ("multi30k", "files"):
        from transformer.data.translation import build_translation_data
        return build_translation_data(cfg, env, run_dir)
    raise ValueError(f"data.name={name!r}: must be copy, multi30k or files")
