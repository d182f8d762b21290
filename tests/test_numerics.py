"""tests/helpers/numerics.py: the tolerance of two summation orders holds for fp32 sums in other orders and fails
a difference that rounding cannot make."""
import numpy as np
import pytest
import torch

from tests.helpers.numerics import close_scaled, tolerance


@pytest.mark.parametrize("n", [8, 64, 1000, 4096])
def test_sequential_and_blocked_sums_stay_within_the_tolerance(n):
    """512 sums of n terms of random sign: one term after another (cumsum), torch's blocked sum and float64's
    exact-to-fp32 one agree within tolerance(float32, n)."""
    x = torch.from_numpy(np.random.default_rng(n).standard_normal((512, n)).astype(np.float32))
    sequential = x.cumsum(-1)[:, -1]
    blocked, exact = x.sum(-1), x.double().sum(-1).float()
    assert close_scaled(sequential, exact, n) and close_scaled(blocked, exact, n)
    assert close_scaled(sequential, blocked, n)


def test_a_difference_beyond_rounding_fails():
    """A weight off by ten tolerances of its tensor's scale at one element is not taken for rounding."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    off = x.clone()
    off[3, 5] += 10 * tolerance(torch.float32, 64) * float(x.abs().max())
    assert close_scaled(x, x, 64) and not close_scaled(off, x, 64)
