"""The model a run trains (`build_model`: its arguments from the `model` config, its options from `trainer`)
and all its wrapping for training, in one function: device placement, precision (the autocast dtype and the
fp16 grad scaler), backend switches, activation checkpointing, DistributedDataParallel and torch.compile. The
entry point calls `parallelize(build_model(cfg, data), cfg, env)` and gives the result to the Trainer, which
wraps nothing itself.
"""
import contextlib
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer.dist import DistEnv
from transformer.experimental import fp8, regional_compile
from transformer.model import ModelOptions, Transformer
from transformer.training.components.loss import choose as choose_loss
from transformer.training.reporting.logs import note, warn
from transformer.training.speed import speedups
from transformer.training.speed.graphs import check_cuda_graphs


def autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of the forward pass, or None for fp32. auto means bf16 where the device multiplies
    bf16 in hardware and fp32 elsewhere: on a CPU, oneDNN runs bf16 products on AMX or AVX512-BF16 units but
    emulates them elsewhere, far more slowly than fp32 (docs/benchmarks/cpu.md). fp16 has no fast CPU kernels and
    stays fp32 there. A rule, not a timing: two runs of one command must train in the same precision."""
    if precision == "fp32" or device.type not in ("cpu", "cuda"):
        return None
    if precision == "auto":
        return torch.bfloat16 if speedups.native_bf16(device) else None
    if device.type == "cpu":
        return torch.bfloat16 if precision == "bf16" else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[precision]  # fp8: float8 Linears


def build_model(cfg, data) -> "Transformer":
    """A new Transformer for the run: the `model` section and `data`'s vocabularies say what it is, the trainer's
    bf16_residual and unpadded_attention how it computes (constructor options, not flags set afterwards)."""
    return Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab,
                                   options=ModelOptions.from_trainer(cfg.trainer))


@dataclass
class Parallelized:
    """A model ready to train, as `parallelize` returns it.

    Attributes:
        model: the plain module on the device. Its state_dict is the checkpoint's (parameter names
            unchanged by any wrapper); the optimiser, EMA, validation, decoding and saving use it.
        net: what the training step calls: `model`, wrapped in DDP when distributed, compiled with
            trainer.compile. Same parameters as `model`.
        amp_dtype: the forward pass's autocast dtype (torch.bfloat16 / torch.float16), None for fp32.
        scaler: the loss scaler, enabled for fp16 only (a no-op otherwise).
        device: the device `model` lives on.
        loss: the label-smoothed loss the training step runs (trainer.loss, "auto" chosen for the device).
    """

    model: torch.nn.Module
    net: torch.nn.Module
    amp_dtype: Optional[torch.dtype]
    scaler: torch.amp.GradScaler
    device: torch.device
    loss: str = "fused"

    def autocast(self) -> ContextManager:
        """The forward pass's autocast context (trainer.precision), the same for training and validation."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


def parallelize(model: torch.nn.Module, cfg, env: DistEnv) -> Parallelized:
    """Moves `model` to `env.device` and applies every training wrapper `cfg.trainer` asks for.

    In order: precision (trainer.precision: the autocast dtype, with a warning where bf16 is emulated, and a
    grad scaler enabled for fp16; fp8 refused where it cannot run, else its Linear layers converted: fp8.py),
    backend switches (TF32, deterministic cuBLAS, attention kernels, CPU allocator:
    speedups.configure_backends), activation checkpointing (per layer, in place: parameter names
    unchanged), DDP when the run has more than one worker, then torch.compile over the result.

    This is the one place a sharded data-parallel wrapper (FSDP2's `fully_shard` per encoder/decoder layer,
    then on the root) would plug in, in place of DDP: the Trainer only calls `net` (and DDP's `no_sync()`
    between micro-batches, FSDP2's `set_requires_gradient_sync` there), steps the optimiser on `model`'s
    parameters and saves `model.state_dict()`, which sharding would turn into a gathered or distributed
    checkpoint.

    Args:
        model: the Transformer, built identically on every rank, on the CPU.
        cfg: the run's config; reads trainer.precision, activation_checkpointing, compile, ddp_bucket_mb,
            ddp_static_graph, tf32, deterministic and keep_freed_memory.
        env: the distributed environment (device, whether distributed).

    Returns:
        A `Parallelized`: the plain model, the module the training step calls, the autocast dtype, the
        grad scaler, the device and the loss implementation.
    """
    tcfg = cfg.trainer
    fp8.check(tcfg, env.device)  # a CPU, a GPU before sm_89, no torchao: refused, one line
    check_cuda_graphs(tcfg, env.device)  # before anything moves to the device
    model = model.to(env.device)
    amp_dtype = autocast_dtype(tcfg.precision, env.device)
    if tcfg.precision == "auto" and env.device.type == "cpu":
        note(f"trainer.precision=auto: {'bf16' if amp_dtype else 'fp32'} (this CPU "
             f"{'multiplies' if amp_dtype else 'has no units that multiply'} bf16 in hardware: AMX or AVX512-BF16)")
    slow_bf16 = speedups.emulated_bf16(env.device) if amp_dtype == torch.bfloat16 else None
    if slow_bf16:
        warn(slow_bf16)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    speedups.configure_backends(tcfg, env.device)
    if tcfg.precision == "fp8":  # transformer/experimental/fp8.py: float8 products, under the bf16 autocast above
        note(f"trainer.precision=fp8: {len(fp8.convert(model))} linear layers multiply in float8")
    if model.options != ModelOptions.from_trainer(tcfg):  # a caller's mistake, not a user's: say it plainly
        raise ValueError(f"the model was built with {model.options}, the trainer config asks for "
                         f"{ModelOptions.from_trainer(tcfg)}: build it with build_model(cfg, data)")
    if tcfg.unpadded_attention:  # transformer/experimental/varlen.py: the training forward on packed real tokens
        if env.device.type == "cuda" and amp_dtype is None:
            warn("trainer.unpadded_attention with fp32: the varlen kernels take bf16 and fp16 only, so attention "
                 "re-pads each call (slower than the padded model); use trainer.precision=bf16")
    if tcfg.compile and (tcfg.static_shapes or tcfg.cuda_graphs):  # a graph per static shape, not one dynamic one
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    regional = tcfg.compile and tcfg.compile_scope == "layers"
    if regional:  # before checkpointing, which then recomputes the compiled layer
        regional_compile.compile_layers(model)
    if tcfg.activation_checkpointing:
        speedups.checkpoint_layers(model)
    # trainer.cuda_graphs all-reduces its flat gradient buffer itself (transformer/training/speed/graphs.py)
    net = DDP(model, **speedups.ddp_kwargs(tcfg, env.device)) if env.distributed and not tcfg.cuda_graphs else model
    if tcfg.compile and not regional:
        net = torch.compile(net)
    loss = choose_loss(tcfg.loss, env.device, tcfg.cuda_graphs, tcfg.compile)
    if tcfg.loss == "auto" and loss == "compiled":  # the first step then compiles it: seconds, said once
        note("trainer.loss=auto: the compiled label-smoothed loss (torch.compile; trainer.loss=fused to avoid it)")
    return Parallelized(model, net, amp_dtype, scaler, env.device, loss)
