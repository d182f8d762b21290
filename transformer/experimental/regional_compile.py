"""Experimental: trainer.compile_scope=layers (torch.compile per encoder and decoder layer) and the report of
Inductor's on-disk compile cache. Neither has been timed on a GPU against whole-model compile: docs/performance.md
names the measurement that would promote them."""
from typing import Optional

import torch


def compile_layers(model: torch.nn.Module) -> None:
    """trainer.compile_scope=layers: torch.compile each encoder and decoder layer instead of the whole model
    (PyTorch's "regional compilation"). Dynamo compiles a layer class's `forward` once and every instance of the
    class reuses it (parameters are graph inputs), so a model compiles two graphs, an encoder layer and a
    decoder layer, whatever N is: the compile time of two layers instead of 2N layers and the glue between them
    (docs/benchmarks/switches.md measures both). Embeddings, the memory projection and the generator stay eager, and no
    kernel is fused across a layer boundary. Only the training forward is compiled, as with the whole model:
    validation (no gradients) and incremental decoding (a cache) call the layers eagerly. Every size of a
    layer's inputs is dynamic from the first call, the packings' integers too (dynamic=True: as integers they
    cannot be marked, and left static each one that changes compiled the layers again, three graphs a layer on
    packed token budgets), so the varying batch shapes (and static shapes, each captured by CUDA graphs) share
    the one graph. The forward is wrapped per instance: parameter names are unchanged."""
    for layer in [*model.encoder, *model.decoder]:
        layer.forward = _compiled_layer(layer.forward)


def _compiled_layer(forward):
    compiled = torch.compile(forward, dynamic=True)

    def run(*args, **kwargs):
        if kwargs.get("cache") is not None or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            # dynamic=True alone left a size static (a view's base: the padding bias, a layer's slice of the
            # memory's keys and values), and the second batch size compiled the decoder layer again
            for u in (t, t._base) if t._base is not None else (t,):
                for dim in range(u.dim()):
                    torch._dynamo.maybe_mark_dynamic(u, dim)
        return compiled(*args, **kwargs)
    return run


def _tensors(obj):
    """The tensors in nested tuples (VarlenMask and Packing are named tuples), lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def compile_cache_hits() -> Optional[dict]:
    """Inductor's on-disk cache this process so far: compiled graphs found there (`hits`, each a forward or a
    backward) and compiled anew (`misses`), and the same for AOTAutograd's joint graphs (`aot_hits`,
    `aot_misses`); None without Dynamo. A warm cache turns a compile of minutes into seconds: the bench reports
    these so a run says whether it had one (benchmarks/compile_cache.py carries it between GPU machines)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"]),
            "aot_hits": int(aot["autograd_cache_hit"]), "aot_misses": int(aot["autograd_cache_miss"])}
