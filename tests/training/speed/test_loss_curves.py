"""The model's speed switches keep the loss curve (issue: within 2% over 300 steps on a CPU at a small size):
model=tiny on the copy task with varied lengths (benchmarks/loss_curves.py), the same seed, batches and
initial weights; the mean relative gap between the smoothed curves stays under 2%."""
import functools

import pytest

from benchmarks.loss_curves import compare, train
from tests.helpers.models import one_thread  # noqa: F401 (autouse fixture)
from transformer.training.speed.speedups import native_bf16_cpu

pytestmark = pytest.mark.slow


@functools.cache
def fp32_curve():
    """The reference curve, trained once for both comparisons; each test gets its own copy."""
    return tuple(train("fp32", 300, 1234))


@pytest.fixture()
def fp32(one_thread):  # noqa: F811 (the fixture)
    return list(fp32_curve())


def test_unpadded_attention_keeps_the_curve(fp32):
    r = compare({"unpadded": train("unpadded", 300, 1234)}, fp32, 20)["unpadded"]
    assert r["mean_rel_gap"] < 0.02, r


def test_unpadded_attention_is_the_same_arithmetic():
    """Without dropout (whose masks the packed rows draw differently) the first steps agree to rounding."""
    r = compare({"unpadded": train("unpadded", 20, 1234, dropout=0.0)}, train("fp32", 20, 1234, dropout=0.0), 5)
    assert r["unpadded"]["first_apart"] is None, r


@pytest.mark.skipif(not native_bf16_cpu(), reason="bf16 products are emulated on this CPU (slow)")
def test_bf16_residual_keeps_the_curve(fp32):
    r = compare({"bf16_residual": train("bf16_residual", 300, 1234)}, fp32, 20)["bf16_residual"]
    assert r["mean_rel_gap"] < 0.02, r
