"""Who this worker is, and the collectives the trainer needs. The one place that reads rank variables.

Global rank (`rank`, 0..world_size-1 across all nodes) decides who writes files; local rank
(`local_rank`, 0..nproc_per_node-1 on this node) decides which GPU this worker uses. They are
never interchangeable.
"""
import datetime
import functools
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as torch_dist

# Imported before any process group exists: its functions take `group=group.WORLD` as a default argument,
# so imported later (DDP does so lazily) they would keep the default group alive for good (see close()).
import torch.distributed.nn.functional  # noqa: F401

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch_dist.barrier()

    def all_reduce_sum(self, values: List[float]) -> List[float]:
        """Sums a few numbers over ranks (fp64, so token counts stay exact)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch_dist.all_reduce(t)
        return t.tolist()

    def all_reduce_max(self, values: List[float]) -> List[float]:
        """The largest of each number over ranks (transformer-bench: the slowest rank's wall time)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
        return t.tolist()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sums a tensor over ranks in place and returns it. With NCCL the reduction is queued on the GPU and
        nothing waits for it; gloo reduces CPU tensors at once."""
        if self.distributed:
            torch_dist.all_reduce(t)
        return t

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0, device=self._comm_device())
        return box[0]

    def gather_objects(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        torch_dist.gather_object(obj, out, dst=0)
        return out

    def _comm_device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo only CPU ones.
        return self.device if torch_dist.get_backend() == "nccl" else torch.device("cpu")


_ENV = DistEnv()


def get_env() -> DistEnv:
    return _ENV


def rank_zero(fn: Callable) -> Callable:
    """Runs `fn` on global rank 0 only (returns None elsewhere). Every file, log line, metric,
    TensorBoard event and checkpoint write of the trainer goes through a function wrapped in this."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _ENV.rank == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper


def torchrun_env() -> Optional[dict]:
    """RANK/LOCAL_RANK/WORLD_SIZE set by torchrun (or srun + torchrun), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
        return {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                "world_size": world_size, "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world_size))}
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # hydra/launcher=slurm: one Slurm task per GPU and no torchrun; submitit derives the ranks from
        # SLURM_PROCID/SLURM_LOCALID and exports MASTER_ADDR/MASTER_PORT for env://. It keeps a MASTER_PORT
        # already set (conf/hydra/launcher/slurm.yaml sets a free one) but refuses to export over it.
        import submitit

        e = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return {"rank": e.rank, "local_rank": e.local_rank, "world_size": e.world_size,
                "local_world_size": e.local_world_size}
    return None


def resolve_device(accelerator: str, local_rank: int) -> torch.device:
    """The device of this worker: the GPU of its *local* rank, or the CPU. Impossible requests are the user's
    (ValueError, reported as one line)."""
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ValueError("trainer.accelerator='gpu': torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if accelerator == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are visible "
                         "(more workers per node than GPUs: lower trainer.devices or --nproc-per-node)")
    return torch.device("cuda", local_rank)


def init(rank: int, local_rank: int, world_size: int, accelerator: str, timeout_s: int,
         store: Optional[torch_dist.Store] = None) -> DistEnv:
    """Joins the process group (when world_size > 1) and records this worker's identity.

    The spawn path passes the parent's `store`. Under torchrun, env:// reads MASTER_ADDR/MASTER_PORT,
    except where torchrun shares its agent's store across restart attempts (see `_attempt_store`).
    """
    global _ENV
    device = resolve_device(accelerator, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not torch_dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = device if device.type == "cuda" else None
        if store is None:
            store = _attempt_store(rank, world_size, timeout)
        if store is not None:
            torch_dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                          device_id=device_id)
        else:
            _init_from_env(backend, rank, world_size, timeout, device_id)
    _ENV = DistEnv(rank, local_rank, world_size, device)
    return _ENV


def _init_from_env(backend: str, rank: int, world_size: int, timeout: datetime.timedelta, device_id) -> None:
    """env://: rank 0 listens on MASTER_ADDR:MASTER_PORT. A port another process holds is the launcher's
    setting, not a bug: one line naming it (exit code 2) instead of a traceback, while the other ranks would
    wait trainer.timeout_s for a store that never comes (srun kills them on this exit)."""
    try:
        torch_dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                      timeout=timeout, device_id=device_id)
    except torch_dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise ValueError(f"MASTER_PORT={os.environ.get('MASTER_PORT')}: address already in use on "
                         f"{os.environ.get('MASTER_ADDR')} (another process listens there): export a free "
                         "MASTER_PORT, or torchrun --master-port") from None


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Optional[torch_dist.Store]:
    """torchrun's agent store outlives restart attempts, keys included (the default since torch 2.5), so
    a restarted worker can read the address a dead one published and fail to connect ("Connection
    refused" in connectFullMesh; pytorch/pytorch#135712). On one node the agent's restart count numbers
    the attempts consistently, so each attempt gets its own key prefix. Across nodes the counts can
    disagree; there TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (which launch/*.sh set) gives each attempt a
    fresh store. Returns None where env:// is safe."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("LOCAL_WORLD_SIZE") != str(world_size):  # several nodes
        if rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            log.warning("torchrun --max-restarts across nodes with a shared rendezvous store: restarts may fail "
                        "to connect; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (launch/*.sh do)")
        return None
    base = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                               is_master=False, timeout=timeout)
    return torch_dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)


def close() -> None:
    """Leaves the process group, which must have no other owner by now (the trainer and its DDP wrapper are
    gone; gc.collect() frees those in reference cycles): destroying it then joins gloo's threads here. Left
    to interpreter finalization, a gloo thread still releasing the last collective's tensor needs the GIL,
    is killed inside a C++ destructor, and the process aborts with SIGABRT ("terminate called without an
    active exception"; about 1 two-worker run in 30 before this)."""
    global _ENV
    if torch_dist.is_initialized():
        gc.collect()
        torch_dist.destroy_process_group()
    _ENV = DistEnv()
