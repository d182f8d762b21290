"""Stacked projections: several Linear maps of one input computed as one matrix product.

Self-attention projects its input to queries, keys and values with one (3·d_model, d_model) matrix
(`<layer>.self_attn.qkv_proj`), and the decoder projects the encoder output ("memory") to the keys and
values of all N_dec cross-attentions at once (`memory_kv_proj`, N_dec·2·d_model rows: layer i's keys, then
its values). One product instead of three (or 2·N_dec) reads the input once, launches one kernel, and
under autocast casts the input to bf16 once.

The mathematics is that of the separate maps: each part keeps its own bias or none (keys have none), and the
weights of checkpoints written with separate q/k/v projections load by `fuse_projections` (old key layout to
new); `split_projections` is its inverse, for exporters that want the separate-projection names.
"""
import math
import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class StackedLinear(nn.Module):
    """len(biased) maps Linear(d_in, d_out) of one input, stacked by rows: weight (n·d_out, d_in); bias
    (number of biased parts, d_out) holds the biases of the parts with `biased[i]` true, the others add none.
    x (..., d_in) -> (..., n·d_out), part i in columns [i·d_out, (i+1)·d_out)."""

    def __init__(self, d_in: int, d_out: int, biased: Sequence[bool]):
        super().__init__()
        self.d_out = d_out
        self.weight = nn.Parameter(torch.empty(len(biased) * d_out, d_in))
        self.bias = nn.Parameter(torch.empty(sum(biased), d_out))
        self.register_buffer("bias_rows", torch.tensor([i for i, b in enumerate(biased) if b], dtype=torch.long),
                             persistent=False)
        # trainer.precision=fp8 (transformer/experimental/fp8.py): (a float8 Linear over `weight`,); in a tuple, so
        # it is no submodule and the state_dict keeps its keys.
        self.float8: Optional[Tuple[nn.Module]] = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each part as nn.Linear draws it (Transformer._init_weights replays them in the separate maps' order)."""
        for part in self.weight.split(self.d_out):
            nn.init.kaiming_uniform_(part, a=math.sqrt(5))
        bound = 1 / math.sqrt(self.weight.size(1))
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.weight.size(0) // self.d_out
        # Zero bias rows for the unbiased parts: their gradient is dropped, so no parameter collects rounding noise.
        bias = self.bias.new_zeros(parts, self.d_out).index_copy(0, self.bias_rows, self.bias)  # (n, d_out)
        if self.float8 is not None:
            out = self.float8[0](x)  # (..., n·d_out), bf16 under autocast
            return out + bias.view(-1).to(out.dtype)
        return F.linear(x, self.weight, bias.view(-1))  # (..., n·d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.weight.size(1)}, d_out={self.d_out}, parts={self.weight.size(0) // self.d_out}"


class Stack(NamedTuple):
    """One stacked projection `fused` (a module path) and the separate nn.Linear paths it replaces, in row order."""
    fused: str
    parts: List[str]
    biased: List[bool]


SELF_PARTS = (("q_proj", True), ("k_proj", False), ("v_proj", True))
CROSS_PARTS = (("k_proj", False), ("v_proj", True))


def _stacks_of_old(keys, prefix: str) -> List[Stack]:
    """The stacks that state-dict `keys` written with separate projections fill (none for the new layout)."""
    stacks, layers = [], set()
    for k in keys:
        if m := re.fullmatch(re.escape(prefix) + r"(.*self_attn)\.q_proj\.weight", k):
            at = prefix + m[1]
            stacks.append(Stack(f"{at}.qkv_proj", [f"{at}.{p}" for p, _ in SELF_PARTS], [b for _, b in SELF_PARTS]))
        elif m := re.fullmatch(re.escape(prefix) + r"decoder\.(\d+)\.cross_attn\.k_proj\.weight", k):
            layers.add(int(m[1]))
    if layers:
        stacks.append(_cross_stack(prefix, len(layers)))
    return stacks


def _cross_stack(prefix: str, n_dec: int) -> Stack:
    parts = [f"{prefix}decoder.{i}.cross_attn.{p}" for i in range(n_dec) for p, _ in CROSS_PARTS]
    return Stack(f"{prefix}memory_kv_proj", parts, [b for _ in range(n_dec) for _, b in CROSS_PARTS])


def _stacks_of_new(state: Dict[str, torch.Tensor]) -> List[Stack]:
    stacks = []
    for k, w in state.items():
        if m := re.fullmatch(r"(.*self_attn)\.qkv_proj\.weight", k):
            stacks.append(Stack(f"{m[1]}.qkv_proj", [f"{m[1]}.{p}" for p, _ in SELF_PARTS], [b for _, b in SELF_PARTS]))
        elif m := re.fullmatch(r"(.*)memory_kv_proj\.weight", k):
            stacks.append(_cross_stack(m[1], w.size(0) // (2 * w.size(1))))
    return stacks


def fused_sources(stack: Stack) -> Dict[str, List[str]]:
    """{fused key: the old keys stacked into it, in order}: weights are concatenated by rows, biases stacked."""
    return {f"{stack.fused}.weight": [f"{p}.weight" for p in stack.parts],
            f"{stack.fused}.bias": [f"{p}.bias" for p, b in zip(stack.parts, stack.biased, strict=True) if b]}


def stack_tensors(key: str, tensors: List[torch.Tensor]) -> torch.Tensor:
    """The fused tensor of `key` from its parts (a weight's (d_out, d_in) blocks, or a bias's (d_out,) rows)."""
    return torch.stack(tensors) if key.endswith(".bias") else torch.cat(tensors)


def fuse_projections(state: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
    """Old layout to new, in place (and returned): the separate q/k/v weights of every self-attention and the
    k/v weights of the cross-attentions under `prefix` are replaced by their stacked projections. A state in
    the new layout is returned unchanged."""
    for stack in _stacks_of_old(list(state), prefix):
        for key, sources in fused_sources(stack).items():
            state[key] = stack_tensors(key, [state.pop(s) for s in sources])
    return state


def split_projections(state: Dict[str, torch.Tensor], views: bool = False) -> Dict[str, torch.Tensor]:
    """New layout to old (the inverse of `fuse_projections`): a new dict in the key order the separate-projection
    model had (each attention's q, k and v just before its out_proj), e.g. for exporters writing
    `...self_attn.q_proj.weight` names. The parts are copies, or views of the stacked tensors with `views`."""
    emit: Dict[str, Dict[str, torch.Tensor]] = {}  # an out_proj weight key -> the parts that came before it
    fused = set()
    for stack in _stacks_of_new(state):
        w, b = state[f"{stack.fused}.weight"], state[f"{stack.fused}.bias"]
        d_out = w.size(0) // len(stack.parts)
        biases = iter(b.unbind(0))
        for i, (part, biased) in enumerate(zip(stack.parts, stack.biased, strict=True)):
            at = emit.setdefault(part.rsplit(".", 1)[0] + ".out_proj.weight", {})
            at[f"{part}.weight"] = w[i * d_out:(i + 1) * d_out]
            if biased:
                at[f"{part}.bias"] = next(biases)
        fused.update(fused_sources(stack))
    out = {}
    for k, v in state.items():
        for name, t in emit.get(k, {}).items():
            out[name] = t if views else t.clone()
        if k not in fused:
            out[k] = v
    return out


def replay_linear_init(model: nn.Module) -> None:
    """Draws every weight of `model` as the separate-projection model's constructors did, in the same order:
    nn.Linear (kaiming-uniform weights, uniform biases), nn.Embedding (normal), nn.LayerNorm (no draw). With the
    same seed the stacked model so starts from the separate model's numbers and leaves the RNG where it did."""
    fan_in = {}
    for name, t in split_projections(model.state_dict(keep_vars=True), views=True).items():
        path, kind = name.rsplit(".", 1)
        try:
            owner = model.get_submodule(path)
        except AttributeError:  # a part of a stacked projection: an nn.Linear before
            owner = None
        if isinstance(owner, nn.LayerNorm):
            continue
        if isinstance(owner, nn.Embedding):
            t.normal_()
        elif kind == "weight":
            nn.init.kaiming_uniform_(t, a=math.sqrt(5))
            fan_in[path] = t.size(1)
        else:
            bound = 1 / math.sqrt(fan_in[path])
            nn.init.uniform_(t, -bound, bound)


def separate_parameter_order(model: nn.Module) -> List[str]:
    """The names of `model.parameters()` (tied weights once) as the separate-projection model listed them: the
    order of the optimiser state of checkpoints written with it."""
    own = {n for n, _ in model.named_parameters()}
    state = model.state_dict(keep_vars=True)
    return [k for k in split_projections(state, views=True) if k in own or k not in state]


def fuse_optimizer_state(opt_state: dict, model: nn.Module) -> dict:
    """An Adam state_dict written for the separate-projection model, for `model` (stacked): per-element
    moments are stacked exactly like the weights they belong to, so a resumed run continues exactly."""
    groups = opt_state["param_groups"]
    if len(groups) != 1:
        return opt_state
    old = dict(zip(separate_parameter_order(model), groups[0]["params"], strict=True))  # name -> old index
    sources = {}
    for stack in _stacks_of_new(model.state_dict()):
        sources.update(fused_sources(stack))
    state = {}
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        parts = [opt_state["state"].get(old[s]) for s in sources.get(name, [name])]
        if any(p is None for p in parts):
            continue
        stacked = name in sources
        state[i] = {k: (stack_tensors(name, [p[k] for p in parts]) if stacked and v.dim() > 0 else v)
                    for k, v in parts[0].items()}
    return {"state": state, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}
