"""An exponential moving average of the weights (Polyak averaging): shadow = d * shadow + (1 - d) * weights
after every optimiser step, on the device and without a host sync. Validation scores the average when it is
on, and checkpoints carry it, so a resumed run continues it bit for bit."""
import contextlib
from typing import Dict, Iterator, List

import torch


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.model, self.decay = model, decay
        # Floating-point state only (parameters and buffers such as the positional table are all floats here);
        # fp32 copies, so a bf16/fp16 model still averages in full precision.
        state = model.state_dict()
        self.names = [n for n, t in state.items() if t.is_floating_point()]
        self.shadow: Dict[str, torch.Tensor] = {n: state[n].detach().float().clone() for n in self.names}
        # The model's own tensors (a state_dict holds aliases of them, updated in place by every step), kept
        # once: a state_dict() every step walks the whole module tree on the host.
        self.current = [state[n] for n in self.names]
        self.averages = [self.shadow[n] for n in self.names]  # the same tensors, in the same order
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """After an optimiser step. The first steps use a smaller decay, (1 + n) / (10 + n), so the average
        is not dominated by the random initial weights."""
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        current = [t.float() for t in self.current]
        torch._foreach_lerp_(self.averages, current, 1.0 - d)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own weights again after it."""
        backup = [t.detach().clone() for t in self.current]
        self._copy_into_model(self.averages)
        try:
            yield
        finally:
            self._copy_into_model(backup)

    @torch.no_grad()
    def _copy_into_model(self, tensors: List[torch.Tensor]) -> None:
        """`tensors` in the order of `self.names` into the model's own tensors."""
        for mine, new in zip(self.current, tensors, strict=True):
            mine.copy_(new)

    def averaged_state(self) -> Dict[str, torch.Tensor]:
        """The model's state_dict with the averaged weights, in the model's own dtypes (a model-only checkpoint)."""
        state = self.model.state_dict()
        return {n: (self.shadow[n].to(t.dtype) if n in self.shadow else t).detach().clone() for n, t in state.items()}

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for n in self.names:
            self.shadow[n].copy_(state["shadow"][n])
