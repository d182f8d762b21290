"""trainer.precision=fp8: the matrix products of the Linear layers in float8 (torchao's float8 training),
everything else under bf16 autocast, on NVIDIA GPUs with float8 tensor cores (compute capability 8.9 and newer:
Ada, Hopper, Blackwell).

torchao swaps each chosen nn.Linear for its Float8Linear, which holds the same weight and bias Parameters
(fp32, as before) and casts the input, the weight and the output's gradient to float8 with one dynamic scale
per tensor at every product. Parameter names, shapes and dtypes are unchanged, so the state_dict, the
checkpoints, EMA and the optimiser see exactly what a bf16 run sees, and a checkpoint moves freely between
fp8 and bf16/fp32 runs. Kept out: the generator (the output projection over the vocabulary: its logits feed
the loss, it is tied to the embedding and it scores only the first `n_out` rows of its matrix), and every
product whose dimensions are not multiples of 16 (float8 GEMMs need them; the token count, the weight
gradient's inner dimension, is padded to one). The stacked projections
(transformer/model/projections.py) are no nn.Linear; each gets a Float8Linear over its stacked weight,
held outside the module tree (`StackedLinear.float8`), and adds its part biases itself.
"""
import importlib
from typing import List, Optional

import torch
from torch import nn

from transformer.config import ConfigError
from transformer.model.projections import StackedLinear

MIN_CAPABILITY = (8, 9)
INSTALL = "pip install -e '.[fp8]' (the fp8 extra: torchao)"


def refusal(device: torch.device) -> Optional[str]:
    """Why trainer.precision=fp8 cannot run on `device` (one line for `error:`), or None where it can."""
    if device.type != "cuda":
        return (f"trainer.precision=fp8 needs an NVIDIA GPU with float8 tensor cores (compute capability >= 8.9: "
                f"Ada, Hopper or newer); this run is on the {device.type.upper()}: use trainer.precision=bf16 or auto")
    if torch.version.hip:
        return "trainer.precision=fp8 runs on NVIDIA GPUs only; this torch is a ROCm build: use trainer.precision=bf16"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"trainer.precision=fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); "
                f"{torch.cuda.get_device_name(device)} ({device}) is sm_{capability[0]}{capability[1]}, without "
                "float8 tensor cores: use trainer.precision=bf16")
    try:
        importlib.import_module("torchao.float8").convert_to_float8_training  # noqa: B018 (the API this needs)
    except (ImportError, AttributeError):
        return f"trainer.precision=fp8 needs torchao's float8 training, not importable here: {INSTALL}"
    return None


def devices_of(accelerator: str) -> List[torch.device]:
    """The devices the workers of a run with trainer.accelerator=`accelerator` would use (transformer.dist's
    choice): every visible GPU, or the CPU."""
    if accelerator == "cpu" or not torch.cuda.is_available():
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def check(tcfg, device: Optional[torch.device] = None) -> None:
    """ConfigError (one `error:` line, exit code 2) if trainer.precision=fp8 cannot run: on `device`, or, before
    any worker starts, on any device the run would use."""
    if tcfg.precision != "fp8":
        return
    for d in [device] if device is not None else devices_of(tcfg.accelerator):
        why = refusal(d)
        if why is not None:
            raise ConfigError(why)


def convertible(module: nn.Module, fqn: str = "") -> bool:
    """The module filter: the model's products that float8 takes (see the module docstring)."""
    from transformer.model.transformer import Generator

    if isinstance(module, Generator) or not isinstance(module, (nn.Linear, StackedLinear)):
        return False
    return all(n % 16 == 0 for n in module.weight.shape)


def convert(model: nn.Module, emulate: bool = False) -> List[str]:
    """Puts the products of `model`'s convertible layers in float8, in place; returns their names. Call it on
    the model on its device, before DDP and torch.compile. `emulate`: torchao's emulation (tests on a CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # pad_inner_dim: torch._scaled_mm wants every inner dimension a multiple of 16, and the weight gradient's is
    # the batch's token count, which varies from batch to batch (torchao's emulation never checks it).
    config = Float8LinearConfig(emulate=emulate, pad_inner_dim=True)
    names = [n for n, m in model.named_modules() if convertible(m, n)]
    convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    for m in model.modules():
        if isinstance(m, StackedLinear) and convertible(m):
            with torch.device("meta"):  # no storage: the stacked weight is the Linear's weight
                linear = nn.Linear(m.weight.size(1), m.weight.size(0), bias=False)
            linear.weight = m.weight
            m.float8 = (convert_to_float8_training(linear, config=config),)
    return names
