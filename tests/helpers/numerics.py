"""Tolerances for two floating-point computations of the same numbers that sum in different orders (padded
against packed rows, a cache against the full pass, one kernel's blocking against another's).

The argument: each addition rounds its partial sum by at most u = eps/2 of it, with a sign that is as good as
random, so the n roundings of an n-term sum add up like a random walk: an error of about u * sqrt(n) times the
size of the sums (Higham and Mary, "A new approach to probabilistic rounding error analysis", 2019); two
orders differ by about sqrt(2) of that. The size of the sums is the tensor's largest magnitude: an element
near zero got there by cancellation and keeps the rounding of its large terms, so the error is absolute at
the tensor's scale and relative only for its large elements. SLACK, in eps: 5 standard deviations of that
walk (the tail over 10^5 elements) times sqrt(2) for two orders times sqrt(4) for the four or so reductions
in a row whose errors add (a layer's output feeds the next one's sums), 5 * 2.8 * u = 7 eps, rounded up to 8;
n is the longest sum whose order differs, which the caller names. A CPU's kernel level (ATEN_CPU_CAPABILITY:
default, avx2, avx512) changes the blocking, not this bound; the most the model tests needed at any of them
was 2.3 eps sqrt(n) (2026-12-02). Computations that run the same kernels in the same order stay compared
exactly (torch.equal)."""
import math

import torch

SLACK = 8.0


def tolerance(dtype: torch.dtype, n: int) -> float:
    """The relative difference two orders of n-term sums in `dtype` stay within: SLACK * eps * sqrt(n)."""
    return SLACK * torch.finfo(dtype).eps * math.sqrt(max(n, 1))


def scaled(expected: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> dict:
    """rtol and atol for torch.testing.assert_close/torch.allclose against `expected`: atol at the tensor's scale
    (its largest magnitude), both tolerance(dtype, n); dtype is expected's unless given (a result rounded to a
    narrower type than it was summed in)."""
    tol = tolerance(dtype or expected.dtype, n)
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return {"rtol": tol, "atol": tol * scale}


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype | None = None,
                        msg=None) -> None:
    """torch.testing.assert_close within scaled(expected, n, dtype)."""
    torch.testing.assert_close(actual, expected, **scaled(expected, n, dtype), msg=msg)


def close_scaled(actual: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> bool:
    """torch.allclose within scaled(expected, n, dtype)."""
    return torch.allclose(actual, expected, **scaled(expected, n, dtype))


