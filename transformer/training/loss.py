"""Label-smoothed cross-entropy (paper Section 5.4, epsilon_ls = 0.1).

The target class gets probability 1 - eps and the eps mass is spread evenly over the other V - 1
classes, as in fairseq's `label_smoothed_cross_entropy`. The Annotated Transformer instead spreads
eps over V - 2 classes (it also zeroes the <pad> column) and minimises KL(q || p); KL and cross-entropy
differ by the entropy of q, a constant, so the gradients differ only through the V-1 vs V-2 split:
with V = 10,000 that is a relative change of 1e-4 in each smoothing weight. Reported loss values are
cross-entropy (not KL) so they are comparable to fairseq's.
"""

import torch
import torch.nn.functional as F


def label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (smoothed loss, plain NLL), each summed over non-pad targets.

    Summed, not averaged: the trainer divides by the token count of the whole optimiser step
    (all micro-batches, all ranks), so every token weighs the same whatever the batch split.
    """
    V = logits.size(-1)
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, V)  # (B*T, V), fp32 even under autocast
    target = target.reshape(-1)
    # Pad positions are zeroed, not dropped: boolean indexing (lprobs[keep]) needs the count of kept rows
    # on the host, a GPU sync on every call.
    pad = target == pad_id  # (B*T,)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1).masked_fill(pad, 0.0)  # (B*T,)
    if epsilon == 0:
        return nll.sum(), nll.sum()
    smooth = -lprobs.sum(dim=-1).masked_fill(pad, 0.0)  # (B*T,) sum over all V classes
    eps_i = epsilon / (V - 1)
    # sum_c q_c * -log p_c with q_target = 1 - eps and q_other = eps / (V - 1):
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss.sum(), nll.sum()
