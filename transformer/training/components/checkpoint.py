"""Checkpoint files: atomic writes, safe loads, keep-last-K, and finding the last good one to resume from.

A checkpoint is the trainer's `state_dict()`: tensors and primitives only, so it loads with
`torch.load(path, weights_only=True)` and no pickled code ever runs. It carries `model_args` and the
tokenizer state, so `load_model(path)` rebuilds a working model from the file alone.
"""
import logging
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from transformer.atomic import atomic_open, fsync_dir, pending
from transformer.checkpoint_files import FOLDER, FORMAT, CheckpointError, step_files
from transformer.config import schema_defaults
from transformer.environment import machine_error
from transformer.model.projections import fuse_optimizer_state, fuse_projections
from transformer.model.transformer import ModelArgs, Transformer

log = logging.getLogger(__name__)

# Temporary files of interrupted writes: ".step_00000100.pt.<random>.tmp", ".last.pt.link.tmp", ...
TEMP_FILE = re.compile(r"^\.(step_\d+|last|best|average_last\d+)\.pt\.[\w-]+\.tmp$")


# When a run stops, how it shows progress, where its inputs are: a resumed run may change these and still
# continue exactly (a larger trainer.max_minutes is how an ended run trains on).
MAY_CHANGE_ON_RESUME = ("trainer.max_minutes", "trainer.max_steps", "trainer.max_epochs", "trainer.resume",
                        "trainer.init_from", "trainer.progress", "data.root", "data.progress")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(saved: dict, current: dict) -> List[str]:
    """`key=old -> new` for each setting (flattened config) in which `current` differs from the config a
    checkpoint was written with, apart from MAY_CHANGE_ON_RESUME; `<none>` marks a key one side lacks. A key
    that an older version's config lacks and that has its schema default now changed nothing."""
    old, new, default = _flat(saved), _flat(current), _flat(schema_defaults())
    keys = sorted(k for k in old.keys() | new.keys() if k.split(".")[0] != "hydra" and k not in MAY_CHANGE_ON_RESUME)
    pairs = [(k, old.get(k, "<none>"), new.get(k, "<none>")) for k in keys]
    return [f"{k}={a} -> {b}" for k, a, b in pairs if a != b and not (k not in old and default.get(k, a) == b)]


def atomic_save(obj, path: Path) -> None:
    """torch.save through a temp file in the same folder, fsync, then rename: a crash leaves the old file or
    the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        writes = _Writes(f)
        try:
            torch.save(obj, writes)
        except RuntimeError:  # torch's writer turns a failed write into "unexpected pos ...": the real cause
            if writes.error is not None:
                raise writes.error from None
            raise


class _Writes:
    """A file torch.save writes to, which keeps the OSError of a failed write (a full disk, say)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_link(src: Path, dst: Path) -> None:
    """Point `dst` at the same file as `src` (hard link; a copy where links are not supported), atomically."""
    tmp = dst.with_name(f".{dst.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    with pending(tmp):
        try:
            os.link(src, tmp)
        except OSError as e:
            if machine_error(e) is not None:  # a full disk: no copy would fit either
                raise
            try:
                _copy_synced(src, tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, dst)
    fsync_dir(dst.parent)


def _copy_synced(src: Path, dst: Path) -> None:
    """A copy of `src` whose bytes are on disk before it is renamed into place: a crash after the rename must
    not leave a last.pt or best.pt of the right name and no contents."""
    import shutil
    with open(src, "rb") as r, open(dst, "wb") as w:
        shutil.copyfileobj(r, w, 1 << 20)
        w.flush()
        os.fsync(w.fileno())


def load_checkpoint(path, map_location="cpu") -> dict:
    """Loads with weights_only=True; a file holding pickled objects, or not a checkpoint of ours, is refused.
    A folder is read as a Hugging Face MarianMTModel (`transformer.interop.hf.import_hf`)."""
    path = Path(path)
    if path.is_dir():  # a Hugging Face model folder (trainer.init_from, translate): imported
        from transformer.interop.hf import import_hf
        return import_hf(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore", UserWarning)
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:  # torch's message would advise weights_only=False: the unsafe step
        raise CheckpointError(f"{path}: not a checkpoint written by transformer-train, or a file holding executable "
                              "pickled objects: refused") from None
    except Exception as e:  # RuntimeError for truncated zips, EOFError for empty files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a checkpoint, or a truncated or corrupt one ({first})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} file")
    if isinstance(ckpt.get("model_args"), dict):  # resume, init_from and averaging compare them as written now
        ckpt["model_args"] = ModelArgs.upgrade(ckpt["model_args"])
        stack_projections(ckpt)
    return ckpt


def stack_projections(ckpt: dict) -> None:
    """A checkpoint written with separate q/k/v projections (by earlier versions), in place, as this version writes
    it: stacked weights (transformer/model/projections.py), and the weight average and Adam moments stacked
    alike, so that such a run resumes exactly. One written since is left as it is."""
    weights = ckpt.get("model")
    if not isinstance(weights, dict) or not any(k.endswith("self_attn.q_proj.weight") for k in weights):
        return
    fuse_projections(weights)
    if isinstance(ckpt.get("ema"), dict):
        fuse_projections(ckpt["ema"]["shadow"])
    if isinstance(ckpt.get("optimizer"), dict):
        with torch.device("meta"):  # the parameter order only: no memory, no random draws
            model = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
        ckpt["optimizer"] = fuse_optimizer_state(ckpt["optimizer"], model)


def model_weights(ckpt: dict) -> dict:
    """The weights a checkpoint's model is used with: the weight average of a run with trainer.ema_decay (the
    weights its validation scored, and so chose best.pt by), else the trained weights."""
    if "ema" not in ckpt:
        return ckpt["model"]
    return {k: ckpt["ema"]["shadow"][k].to(v.dtype) if k in ckpt["ema"]["shadow"] else v
            for k, v in ckpt["model"].items()}


def load_model(path, device="cpu"):
    """(model in eval mode, tokenizer, checkpoint dict) from a checkpoint file alone: the one loader of every
    command. A file that is not a checkpoint of ours, or whose weights do not fit its `model_args`, raises
    CheckpointError naming the file."""
    from transformer.data.tokenizer import tokenizer_from_state
    from transformer.model import ModelArgs, Transformer

    ckpt = load_checkpoint(path)
    try:
        tokenizer = tokenizer_from_state(ckpt["tokenizer"])
        model = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
        model.load_state_dict(model_weights(ckpt))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # not our layout, or weights that do not fit
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: broken checkpoint ({type(e).__name__}: {first})") from None
    return model.to(device).eval(), tokenizer, ckpt


class Checkpointer:
    """Files under `<run_dir>/checkpoints/`: step_<N>.pt (the last `keep_last` kept), last.pt and best.pt
    (hard links to step files, so each state is written once). Only rank 0 ever calls `save`.

    A run goes on from the step it started at: step files after it are of an abandoned line of training (a
    rewind with trainer.resume=PATH, a corrupt newest file skipped). Until this run's first checkpoint removes
    them they are not its own: not resumed, averaged or taken for its last checkpoint."""

    def __init__(self, run_dir: Path, keep_last: int):
        self.folder = Path(run_dir) / FOLDER
        self.keep_last = keep_last
        self.origin: Optional[dict] = None  # the trainer.resume=PATH this line started from, saved in each file
        self.started_at: Optional[int] = None  # the step this run started at; None until it has (or once it saved)

    def step_files(self):
        """(step, path) pairs, newest first, of this line of training."""
        files = step_files(self.folder)
        return files if self.started_at is None else [(s, p) for s, p in files if s <= self.started_at]

    def later_files(self) -> List[Path]:
        """The step files after the step this run started at, oldest first: another line's, which its first save
        removes."""
        files = step_files(self.folder)[::-1]
        return [] if self.started_at is None else [p for s, p in files if s > self.started_at]

    def save(self, state: dict, step: int, is_best: bool) -> Path:
        path = self.folder / f"step_{step:08d}.pt"
        self.folder.mkdir(exist_ok=True)  # not its parents: a run directory that vanished is not made again
        atomic_save({**state, ORIGIN: self.origin} if self.origin is not None else state, path)
        atomic_link(path, self.folder / "last.pt")
        if is_best:
            atomic_link(path, self.folder / "best.pt")
        # By step number among this line's files, so never the one just written: a rewound run's new files are
        # older than an abandoned line's, which would otherwise outnumber them and be kept instead.
        files = step_files(self.folder)
        later = [p for s, p in files if s > step]
        if later:
            log.warning("removed %s: checkpoints after step %d, of the line of training this run abandoned",
                        ", ".join(p.name for p in reversed(later)), step)
        # The file this line started from stays: every rerun names it, and the command line checks it exists.
        start = (self.origin or {}).get("path")
        pruned = [p for s, p in files if s <= step][self.keep_last:]
        for old in later + [p for p in pruned if not same_file(p, start)]:
            old.unlink(missing_ok=True)
        self.started_at = None  # nothing after `step` is left
        return path

    def target(self, link: Path) -> Path:
        """The file that `link` (last.pt or best.pt, hard links) shares its contents with."""
        inode = link.stat().st_ino
        for p in sorted(self.folder.glob("*.pt")):
            if p.name not in ("last.pt", "best.pt") and p.stat().st_ino == inode:
                return p
        return link

    def remove_stale_temp_files(self):
        """Deletes the temporary files (atomic_open's `.NAME.*.tmp`, atomic_link's `.NAME.link.tmp`) that a
        write killed mid-way left in this folder, and only those; returns their paths."""
        stale = [p for p in self.folder.glob(".*.tmp") if p.is_file() and TEMP_FILE.match(p.name)]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

    def find_resume(self) -> Optional[Tuple[Path, dict]]:
        """The newest step file that loads, with its contents; corrupt ones are skipped with a warning."""
        for _, path in self.step_files():
            try:
                return path, load_checkpoint(path)
            except CheckpointError as e:
                log.warning("skipping corrupt checkpoint: %s", e)
        return None

    def resume_from(self, path: str) -> Tuple[str, Optional[dict], str]:
        """trainer.resume=PATH only starts a line of training: once this run directory holds a good checkpoint
        written since a run started from PATH (the same command again: a Slurm requeue, a torchrun restart),
        the newest such file wins. Returns (the file to load, its contents if already read, why)."""
        found = self.find_resume()
        if found is None:
            return path, None, f"trainer.resume={path}; the run directory holds no checkpoint yet"
        own, ckpt = found
        step = ckpt.get("trainer", {}).get("step")
        if same_file(own, path):
            return str(own), ckpt, f"trainer.resume={path}"
        origin = ckpt.get(ORIGIN) or {}
        if same_file(origin.get("path", ""), path):
            return (str(own), ckpt, f"this run's newest checkpoint, newer than trainer.resume={path} (step "
                    f"{origin.get('step')}), which the run started from")
        # The run directory's files are of another line (a rewind to an earlier file of this run, say): not ours.
        return path, None, f"trainer.resume={path}; {own.name} (step {step}) was not trained from it"


# A checkpoint's record of the trainer.resume=PATH its line of training started from: {"path", "step"}
ORIGIN = "started_from"


def same_file(a, b) -> bool:
    """`a` and `b` name the same file: one inode (best.pt and its step file, say), else one path (a file gone
    since it was recorded)."""
    if not a or not b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
