"""Speed switches of the trainer: TF32, deterministic cuBLAS, bf16 on CPUs, torch.compile with bounded
recompiles, DDP options and activation checkpointing. Each is a `trainer.*` key (transformer/config.py);
docs/performance.md says which defaults were measured and which were not.
"""
import ctypes
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from transformer.data.batch import PAD, Batch
from transformer.data.shapes import pad_to_shape
from transformer.model.layers import no_cudnn_attention
from transformer.training.reporting.logs import note


def configure_backends(tcfg, device: torch.device) -> None:
    """TF32 for float32 matrix products on GPUs that have it (Ampere and newer; it changes nothing under
    bf16 autocast, where the products are bf16 already), and the cuBLAS workspace setting that
    `trainer.deterministic` needs on CUDA (read when cuBLAS starts, so before the first product), and
    attention kernels that need no per-shape plan (transformer/model/layers.py). On CPUs, the allocator
    setting of `keep_freed_memory`."""
    if device.type == "cpu" and tcfg.keep_freed_memory:
        kept = keep_freed_memory()
        note("freed CPU memory %s (trainer.keep_freed_memory)" % ("is kept for reuse" if kept else
                                                                  "goes back to the kernel: not glibc"))
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if tcfg.tf32 else "highest")
    if tcfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    no_cudnn_attention(device)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (glibc's malloc.h)


def keep_freed_memory() -> bool:
    """trainer.keep_freed_memory: glibc's malloc keeps freed memory in the process instead of returning it to
    the kernel. torch's CPU allocator has no cache of its own: every step allocates its activations and
    gradients anew, and glibc serves blocks over 32 MiB (the logits of a 2048-token batch, their gradient)
    with a fresh mmap and returns them on free, trimming the heap above 128 KiB too; the kernel then
    faults in and zeroes every 4 KiB page again, many thousands a step (docs/benchmarks/switches.md). With mmap off
    and the trim threshold at 1 GiB, a step reuses the heap pages of the step before. Returns whether the
    setting took (glibc on Linux; elsewhere it does nothing). Resident memory then stays at its peak, a
    little above the peak without it (docs/benchmarks/switches.md)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1


def native_bf16_tf32(device: torch.device) -> bool:
    """Ampere or newer (or ROCm): bf16 and TF32 in hardware. torch.cuda.is_bf16_supported() also says yes
    where bf16 is only emulated (GPUs before Ampere), which would make precision=auto slower than fp32 there."""
    return device.type == "cuda" and (bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8)


def native_bf16_cpu() -> bool:
    """AMX or AVX512-BF16 (the CPU kinds: docs/benchmarks/cpu.md): oneDNN runs bf16 products in hardware.
    Elsewhere it emulates them, more slowly than fp32. torch.cpu's probes are private, hence the getattr."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware: what trainer.precision=auto asks before it autocasts."""
    if device.type == "cpu":
        return native_bf16_cpu()
    return device.type == "cuda" and native_bf16_tf32(device)


def compute_type(amp_dtype: Optional[torch.dtype], device: torch.device) -> str:
    """The number format the matrix products run in: autocast's, else TF32 where it is on, else fp32."""
    if amp_dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    if native_bf16_tf32(device) and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def emulated_bf16(device: torch.device) -> Optional[str]:
    """Why bf16 autocast is slow on `device` (a warning for an explicit trainer.precision=bf16), or None where
    bf16 products run in hardware."""
    if native_bf16(device):
        return None
    if device.type == "cpu":
        return ("trainer.precision=bf16 on a CPU without AMX or AVX512-BF16: bf16 products are emulated here "
                "and slower than fp32; trainer.precision=fp32 trains faster on this machine")
    if device.type == "cuda":
        return ("trainer.precision=bf16 on a GPU before Ampere (compute capability < 8): bf16 is emulated "
                "there; trainer.precision=fp16 (or auto, fp32 there) trains faster on this GPU")
    return None


def pad_multiple(tcfg) -> int:
    """trainer.pad_to_multiple, or its default: 1, no padding, since every extra position is wasted work. Under
    torch.compile too: lengths are marked dynamic, so rounding them no longer bounds recompilation; the
    generated kernels take symbolic sizes, and the products' and attention's alignment needs are on d_model
    and the mask's row stride (layers.padding_bias), not on the lengths (docs/benchmarks/switches.md, the switches)."""
    return tcfg.pad_to_multiple if tcfg.pad_to_multiple is not None else 1


def prepare_batch(batch: Batch, multiple: int, dynamic: bool, shape: Optional[tuple] = None) -> Batch:
    """Right-pads source and target lengths (on the device) to a multiple of `multiple` with <pad>, which
    every mask and the loss already ignore, and under torch.compile marks batch size and lengths dynamic,
    so one compiled graph serves the varying shapes of token-bucketed batches instead of one per shape.
    With a static `shape` (rows, S, T) (trainer.static_shapes: transformer/data/shapes.py) the batch is
    padded to it instead, lengths and rows, and still marked dynamic under torch.compile: one compilation
    for the ladder's tens of shapes (CUDA graphs capture each), where the second shape would otherwise
    compile the model again (Dynamo's automatic dynamic shapes), a minute of a GPU lease for big."""
    src, tgt_in, tgt_out, packings = batch.src, batch.tgt_in, batch.tgt_out, batch.packings
    if src.dim() == 1:  # packed token budgets (transformer/experimental/packed.py): collated to a static shape
        pass
    elif shape is not None:  # padded static shapes carry no packings (packed budgets replace them)
        src, tgt_in, tgt_out = pad_to_shape(src, tgt_in, tgt_out, shape)
    elif multiple > 1:
        src = _pad_to(src, multiple)
        tgt_in, tgt_out = _pad_to(tgt_in, multiple), _pad_to(tgt_out, multiple)
    if dynamic:
        for t in (src, tgt_in):
            for dim in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        for packing in packings or ():  # unpadded attention: token and sentence counts vary too
            for t in (packing.index, packing.cu_seqlens, packing.lengths):
                torch._dynamo.maybe_mark_dynamic(t, 0)
    return Batch(src, tgt_in, tgt_out, batch.ids, batch.n_tokens, packings)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.size(1) % multiple
    return F.pad(x, (0, extra), value=PAD) if extra else x








def checkpoint_layers(model: torch.nn.Module) -> None:
    """trainer.activation_checkpointing: each encoder and decoder layer keeps only its input for the backward
    pass and recomputes its activations there (about one more forward pass of the stacks, for activation
    memory that no longer grows with N). Dropout masks are replayed exactly (the RNG state is saved),
    so gradients equal those without checkpointing. The forward is wrapped per instance, so parameter
    names, and checkpoints, are unchanged."""
    for layer in [*model.encoder, *model.decoder]:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # validation and decoding: nothing to save memory for
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def ddp_kwargs(tcfg, device: torch.device) -> dict:
    """No unused-parameter search (every parameter gets a gradient); gradients live in DDP's buckets."""
    return {"device_ids": [device.index] if device.type == "cuda" else None, "gradient_as_bucket_view": True,
            "bucket_cap_mb": tcfg.ddp_bucket_mb, "static_graph": tcfg.ddp_static_graph}


def compiled_graphs() -> Optional[int]:
    """Graphs torch.compile has produced in this process so far (Dynamo's counter), or None without it."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"]["unique_graphs"])
