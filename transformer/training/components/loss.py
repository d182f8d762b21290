"""Label-smoothed cross-entropy (paper Section 5.4, epsilon_ls = 0.1).

The target class gets probability 1 - eps and the eps mass is spread evenly over the other V - 1
classes, as in fairseq's `label_smoothed_cross_entropy`. The Annotated Transformer instead spreads
eps over V - 2 classes (it also zeroes the <pad> column) and minimises KL(q || p); KL and cross-entropy
differ by the entropy of q, a constant, so the gradients differ only through the V-1 vs V-2 split:
with V = 10,000 that is a relative change of 1e-4 in each smoothing weight. Reported loss values are
cross-entropy (not KL) so they are comparable to fairseq's.

The loss is a hand-written autograd function over row chunks of the (B*T, V) logits, whatever their
dtype (bf16 under autocast). Written with log_softmax, autograd keeps an fp32 copy of the logits, their
log-probabilities, and the sums of two gradient paths, each a full pass over B*T*V floats. Here one fp32
work buffer of a chunk's rows is allocated per pass and reused by every chunk: the forward pass casts a
chunk into it (bf16 logits; fp32 ones are read where they are), takes each row's maximum, sum and target
logit, overwrites it with exp(x - max) and sums that, keeping only three fp32 numbers a row (log-sum-exp,
the target's logit, the sum of the logits). The backward pass writes the gradient once per chunk,
d loss / d x_j = p_j - eps / (V - 1) - (1 - eps - eps / (V - 1)) [j = target],
computed in fp32 in the buffer and stored into a gradient tensor of the logits' dtype, or (`inplace=True`,
the trainer's call) into the logits' own storage, which nothing reads after the loss: no second
vocabulary-sized tensor for the gradient.

`impl="compiled"` (trainer.loss=compiled) runs the same two passes as two torch.compile'd graphs over the
whole logits, rows and vocabulary dynamic, whose kernels (Triton on GPUs) cast as they read: the forward
reads the logits and keeps three numbers a row, the backward reads them and writes the gradient once (into
the logits with `inplace`); neither allocates a vocabulary-sized tensor
(tests/training/components/test_loss_optim.py). On GPUs,
where each chunk of the fused loss is a dozen kernels that each read or write the whole fp32 chunk, it is the
faster one (docs/benchmarks/switches.md). `choose` picks between them for trainer.loss=auto.
"""

import functools
import os
import shutil

import torch
import torch.nn.functional as F

from transformer.config import LOSSES as IMPLEMENTATIONS  # trainer.loss
from transformer.specials import PAD


def label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int,
                                 impl: str = "fused", inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (smoothed loss, plain NLL), each summed over non-pad targets.

    Summed, not averaged: the trainer divides by the token count of the whole optimiser step
    (all micro-batches, all ranks), so every token weighs the same whatever the batch split.
    `impl`: "fused" (the chunked autograd function), "compiled" (its passes through torch.compile),
    "reference" (log_softmax and autograd, fp32) or "auto" (`choose`; the trainer passes its choice).
    `inplace`: the backward pass overwrites the logits with their gradient (for logits that nothing reads
    after the loss; ignored for a leaf tensor, whose values are the caller's).
    Compiled graphs use `reference_label_smoothed_cross_entropy`, which the compiler fuses itself.
    """
    impl = choose(impl, logits.device)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"trainer.loss={impl!r}: must be one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "reference" or torch.compiler.is_compiling():
        return reference_label_smoothed_cross_entropy(logits, target, epsilon, pad_id)
    inplace = inplace and logits.grad_fn is not None
    if impl == "compiled":
        return _CompiledLoss.apply(logits, target, epsilon, pad_id, inplace)
    return _FusedLoss.apply(logits, target, epsilon, pad_id, rows_per_chunk(logits), inplace)


def forward_backward(net, autocast, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, packings,
                     epsilon: float, impl: str, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's forward pass, label-smoothed loss and backward pass: the one copy both training steps run
    (transformer/training/loop/step.py eagerly, transformer/training/speed/graphs.py inside a CUDA graph).

    src (B, S), tgt_in and tgt_out (B, T), or a packed batch's (N_s,), (N_t,) with its `packings`; `autocast`:
    the forward's context factory; `scale`: what backward runs on, the fp16 grad scaler's `scale` (the identity
    where it is off). Returns the (loss, nll) sums, detached; the gradients are added into `.grad`."""
    with autocast():
        logits = net(src, tgt_in, packings=packings)  # (B, T, V), or (N_t, V) packed
    loss, nll = label_smoothed_cross_entropy(logits, tgt_out, epsilon, PAD, impl=impl, inplace=True)
    scale(loss).backward()
    return loss.detach(), nll.detach()


def choose(loss: str, device: torch.device, cuda_graphs: bool = False, compile: bool = False) -> str:
    """trainer.loss as run on `device`: "auto" becomes "compiled" on CUDA GPUs where torch.compile can build
    its kernels, except under trainer.cuda_graphs without trainer.compile (graphs with the compiled loss were
    measured with the model compiled too: docs/benchmarks/switches.md), and "fused" elsewhere; any other name is
    kept."""
    if loss != "auto":
        return loss
    graphs_ok = not cuda_graphs or compile
    return "compiled" if device.type == "cuda" and graphs_ok and can_compile_for_gpu() else "fused"


@functools.cache
def can_compile_for_gpu() -> bool:
    """Whether torch.compile can make GPU kernels here: Triton for the device, and the C compiler Triton builds
    its launcher with (slim images lack one)."""
    from torch.utils._triton import has_triton

    compiler = os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    return bool(compiler) and has_triton()


@functools.cache
def _compiled(fn):
    """`fn` through torch.compile, made at its first use (compiling costs seconds; most runs never ask), rows and
    vocabulary dynamic: one graph for every batch."""
    return torch.compile(fn, dynamic=True)


def rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows whose fp32 copy fits in a core's cache on CPUs (4 MiB; smaller chunks measured the same:
    docs/benchmarks/code-choices.md); on GPUs few, large chunks, since every chunk costs kernel launches."""
    elements = 1 << 20 if logits.device.type == "cpu" else 1 << 26
    return max(1, elements // logits.size(-1))


class _FusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, epsilon: float, pad_id: int, chunk: int, inplace: bool):
        V = logits.size(-1)
        x = logits.detach().reshape(-1, V)  # (N, V), N = B*T
        t = target.reshape(-1)  # (N,)
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 (gradcheck)
        N = x.size(0)
        lse = torch.empty(N, dtype=compute, device=x.device)  # log sum_j exp x_j
        x_t = torch.empty_like(lse)  # the target's logit
        x_sum = torch.empty_like(lse)  # sum_j x_j
        work = torch.empty(min(chunk, N), V, dtype=compute, device=x.device)  # the one fp32 chunk, reused
        for i in range(0, N, chunk):
            rows = slice(i, i + chunk)
            xc = x[rows]  # (n, V) in the logits' dtype
            c = work[:xc.size(0)]
            if xc.dtype != compute:  # bf16/fp16: one cast into the buffer, read from there (faster than mixed ops)
                xc = c.copy_(xc)
            m = xc.amax(dim=-1, keepdim=True)  # (n, 1)
            x_sum[rows] = xc.sum(dim=-1)
            x_t[rows] = xc.gather(1, t[rows, None]).squeeze(1)
            torch.sub(xc, m, out=c).exp_()  # exp(x - max), in place when xc is the buffer
            lse[rows] = c.sum(dim=-1).log_().add_(m.squeeze(1))
        pad = t == pad_id  # (N,)
        nll, smooth = _row_losses(lse, x_t, x_sum, pad, V)
        ctx.save_for_backward(logits, t, lse, pad)
        ctx.epsilon, ctx.chunk, ctx.inplace = epsilon, chunk, inplace
        return _summed(nll, smooth, epsilon, V)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, t, lse, pad = ctx.saved_tensors
        V = logits.size(-1)
        a, b, c = _gradient_weights(grad_loss, grad_nll, (~pad).to(lse.dtype)[:, None], ctx.epsilon, V)
        x = logits.detach().reshape(-1, V)
        grad = x if ctx.inplace else torch.empty_like(x)  # (N, V) in the logits' dtype
        direct = grad.dtype == lse.dtype  # fp32 (fp64) logits: computed in the gradient's own rows
        work = None if direct else torch.empty(min(ctx.chunk, x.size(0)), V, dtype=lse.dtype, device=x.device)
        for i in range(0, x.size(0), ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            xc = x[rows]
            g = grad[rows] if direct else work[:xc.size(0)]  # (n, V)
            torch.sub(xc, lse[rows, None], out=g).exp_().mul_(a[rows]).sub_(b[rows])
            g.scatter_add_(1, t[rows, None], -c[rows])
            if not direct:
                grad[rows] = g
        return grad.view_as(logits), None, None, None, None, None


class _CompiledLoss(torch.autograd.Function):
    """The fused loss's two passes, each one torch.compile'd graph of the whole (N, V) logits (trainer.loss=compiled).

    Autograd of the compiled log_softmax form (this class's predecessor) had the compiler save the fp32
    log-probabilities for the backward pass and build the gradient from a zeroed fp32 (N, V) tensor: on GPUs,
    four vocabulary-sized fp32 passes (docs/benchmarks/cpu-checks-of-gpu-paths.md, "the compiled loss in two graphs").
    Written as the fused loss's formulas instead, the forward graph reads the logits once and keeps three
    numbers a row, and the backward graph reads them once and writes the gradient once, in the logits' dtype
    and, with `inplace`, into their own storage.
    """

    @staticmethod
    def forward(ctx, logits, target, epsilon: float, pad_id: int, inplace: bool):
        V = logits.size(-1)
        x = logits.detach().reshape(-1, V)  # (N, V)
        t = target.reshape(-1)  # (N,)
        lse, nll, smooth = _compiled(_rows_forward)(x, t, pad_id)  # (N,) each
        ctx.save_for_backward(logits, t, lse)
        ctx.epsilon, ctx.pad_id, ctx.inplace = epsilon, pad_id, inplace
        return _summed(nll, smooth, epsilon, V)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, t, lse = ctx.saved_tensors
        x = logits.detach().reshape(-1, logits.size(-1))
        grad = x if ctx.inplace else torch.empty_like(x)  # (N, V) in the logits' dtype
        _compiled(_rows_backward)(x, t, lse, grad_loss, grad_nll, ctx.epsilon, ctx.pad_id, grad)
        return grad.view_as(logits), None, None, None, None


def _rows_forward(x: torch.Tensor, t: torch.Tensor, pad_id: int):
    """(N, V) logits, (N,) targets -> each row's log-sum-exp, -log p_target and sum_c -log p_c (zero at pads),
    in fp32 (fp64 for fp64 logits): the rows' maximum, exp-sum, logit sum and target logit in one pass."""
    V = x.size(-1)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (N, V), fused into the reads: never stored
    m = xf.amax(dim=-1, keepdim=True)  # (N, 1)
    lse = (xf - m).exp().sum(dim=-1).log() + m.squeeze(1)  # (N,)
    nll, smooth = _row_losses(lse, xf.gather(1, t[:, None]).squeeze(1), xf.sum(dim=-1), t == pad_id, V)
    return lse, nll, smooth


def _rows_backward(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                   grad_nll: torch.Tensor, epsilon: float, pad_id: int, out: torch.Tensor) -> None:
    """Writes d(g_loss * loss + g_nll * nll) / dx into `out` (N, V), which may be `x` itself:
    a_i * p_ij - b_i - c_i [j = t_i], the fused loss's backward in one pointwise pass."""
    V = x.size(-1)
    a, b, c = _gradient_weights(grad_loss, grad_nll, (t != pad_id).to(lse.dtype)[:, None], epsilon, V)
    hit = torch.arange(V, device=x.device)[None, :] == t[:, None]  # (N, V), computed in the kernel
    p = (x.to(lse.dtype) - lse[:, None]).exp()
    out.copy_(a * p - b - c * hit)


def _row_losses(lse: torch.Tensor, x_t: torch.Tensor, x_sum: torch.Tensor, pad: torch.Tensor, V: int):
    """Each row's -log p_target and sum over all V classes of -log p_c, zero at pads, from its log-sum-exp,
    target logit and logit sum (N,). Pads are zeroed, not dropped: boolean indexing needs the count of kept rows
    on the host, a GPU sync on every call."""
    return (lse - x_t).masked_fill(pad, 0.0), (V * lse - x_sum).masked_fill(pad, 0.0)


def _gradient_weights(grad_loss: torch.Tensor, grad_nll: torch.Tensor, keep: torch.Tensor, epsilon: float, V: int):
    """The gradient of g_loss * loss + g_nll * nll is, per row i, a_i * p_ij - b_i - c_i [j = target_i]: (a, b, c),
    each shaped as `keep` (1 for a real target, 0 at pads)."""
    eps_i = epsilon / (V - 1)
    return ((grad_loss + grad_nll) * keep, grad_loss * eps_i * keep,
            (grad_loss * (1.0 - epsilon - eps_i) + grad_nll) * keep)


def reference_label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                                           pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss written with log_softmax (autograd's gradient): the tests' reference."""
    V = logits.size(-1)
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, V)  # (B*T, V), fp32 even under autocast
    target = target.reshape(-1)
    pad = target == pad_id  # (B*T,)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1).masked_fill(pad, 0.0)  # (B*T,)
    if epsilon == 0:
        return nll.sum(), nll.sum()
    smooth = -lprobs.sum(dim=-1).masked_fill(pad, 0.0)  # (B*T,) sum over all V classes
    return _summed(nll, smooth, epsilon, V)


def _summed(nll: torch.Tensor, smooth: torch.Tensor, epsilon: float, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(smoothed loss, NLL) summed over rows, from each row's -log p_target and sum_c -log p_c (zero at pads):
    sum_c q_c * -log p_c with q_target = 1 - eps and q_other = eps / (V - 1)."""
    eps_i = epsilon / (V - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss.sum(), nll.sum()
