"""benchmarks/saved_activations.py: what a forward saves for its backward, counted once per storage."""
import torch

from benchmarks.saved_activations import main, saved_bytes


def test_counts_each_saved_storage_once():
    w = torch.randn(3, 5, requires_grad=True)

    def model(src, tgt):  # x * x saves x twice (one storage); w's product saves x and w
        x = src.float()
        return (x * x) @ w

    by = saved_bytes(model, torch.ones(4, 3, dtype=torch.bfloat16), None)
    assert sum(by.values()) > 0
    assert all(n == torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
               for (dtype, shape), n in by.items())
    assert w.grad is not None


def test_prints_the_totals(capsys):
    main(["model=tiny", "trainer.bf16_residual=true", "--eager", "--batch", "2x5", "--vocab", "50", "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("saved for the backward: ") and "bfloat16" in out[1]
    assert len(out) == 2 + 3
