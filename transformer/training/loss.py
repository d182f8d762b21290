"""Label-smoothed cross-entropy (paper Section 5.4, epsilon_ls = 0.1).

The target class gets probability 1 - eps and the eps mass is spread evenly over the other V - 1
classes, as in fairseq's `label_smoothed_cross_entropy`. The Annotated Transformer instead spreads
eps over V - 2 classes (it also zeroes the <pad> column) and minimises KL(q || p); KL and cross-entropy
differ by the entropy of q, a constant, so the gradients differ only through the V-1 vs V-2 split:
with V = 10,000 that is a relative change of 1e-4 in each smoothing weight. Reported loss values are
cross-entropy (not KL) so they are comparable to fairseq's.

The loss is a hand-written autograd function over row chunks of the (B*T, V) logits. Written with
log_softmax, autograd keeps an fp32 copy of the logits, their log-probabilities, and the sums of two
gradient paths, each a full pass over B*T*V floats: on CPUs those passes cost more than the
generator's matrix product (docs/performance.md). Here each
chunk is cast to fp32 while it sits in cache, and the backward pass writes the gradient once, from
d loss / d x_j = p_j - eps / (V - 1) - (1 - eps - eps / (V - 1)) [j = target].
"""

import torch
import torch.nn.functional as F


def label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (smoothed loss, plain NLL), each summed over non-pad targets.

    Summed, not averaged: the trainer divides by the token count of the whole optimiser step
    (all micro-batches, all ranks), so every token weighs the same whatever the batch split.
    Compiled graphs use `reference_label_smoothed_cross_entropy`, which the compiler fuses itself.
    """
    if torch.compiler.is_compiling():
        return reference_label_smoothed_cross_entropy(logits, target, epsilon, pad_id)
    return _ChunkedLoss.apply(logits, target, epsilon, pad_id, rows_per_chunk(logits))


def rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows whose fp32 copy fits in a core's cache on CPUs (4 MiB; smaller chunks measured the same:
    docs/performance.md); on GPUs few, large chunks, since every chunk costs kernel launches."""
    elements = 1 << 20 if logits.device.type == "cpu" else 1 << 26
    return max(1, elements // logits.size(-1))


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, epsilon: float, pad_id: int, chunk: int):
        V = logits.size(-1)
        x = logits.reshape(-1, V)  # (N, V), N = B*T
        t = target.reshape(-1)  # (N,)
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 (gradcheck)
        lse = torch.empty(x.size(0), dtype=compute, device=x.device)  # log sum_j exp x_j
        x_t = torch.empty_like(lse)  # the target's logit
        x_sum = torch.empty_like(lse)  # sum_j x_j
        for i in range(0, x.size(0), chunk):
            rows = slice(i, i + chunk)
            c = x[rows].to(compute)  # (chunk, V)
            lse[rows] = torch.logsumexp(c, dim=-1)
            x_t[rows] = c.gather(1, t[rows, None]).squeeze(1)
            x_sum[rows] = c.sum(dim=-1)
        # Pad positions are zeroed, not dropped: boolean indexing needs the count of kept rows on the host,
        # a GPU sync on every call.
        pad = t == pad_id  # (N,)
        nll = (lse - x_t).masked_fill_(pad, 0.0)  # -log p_target
        smooth = (V * lse - x_sum).masked_fill_(pad, 0.0)  # sum over all V classes of -log p_c
        ctx.save_for_backward(logits, t, lse, pad)
        ctx.epsilon, ctx.chunk = epsilon, chunk
        return _summed(nll, smooth, epsilon, V)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, t, lse, pad = ctx.saved_tensors
        V = logits.size(-1)
        eps, eps_i = ctx.epsilon, ctx.epsilon / (V - 1)
        keep = (~pad).to(lse.dtype)  # (N,)
        # The gradient of g_loss * loss + g_nll * nll, per row: a * p_j - b - c [j = target].
        a = ((grad_loss + grad_nll) * keep)[:, None]
        b = ((grad_loss * eps_i) * keep)[:, None]
        c = ((grad_loss * (1.0 - eps - eps_i) + grad_nll) * keep)[:, None]
        x = logits.reshape(-1, V)
        grad = torch.empty_like(x)
        for i in range(0, x.size(0), ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            # Out of place first: for fp32 logits, .to() returns the saved tensor itself.
            g = (x[rows].to(lse.dtype) - lse[rows, None]).exp_().mul_(a[rows]).sub_(b[rows])  # (chunk, V)
            grad[rows] = g.scatter_add_(1, t[rows, None], -c[rows])
        return grad.view_as(logits), None, None, None, None


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
