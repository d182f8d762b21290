"""benchmarks/bench_products.py: the step's products recorded (forward and backward), replayed alone, and the
ceiling they leave."""
import re

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.benchmarks import load_benchmark

products = load_benchmark("bench_products")
aten = torch.ops.aten


def test_records_forward_and_backward_products_with_their_layouts():
    x = torch.randn(6, 4, requires_grad=True)
    w, b = torch.randn(5, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    log = products.ProductLog()
    with log:
        F.linear(x, w, b).sum().backward()
        torch.relu(x).sum()  # no product: not recorded
    ops = sorted(func.__name__ for func, _ in log.calls.elements())
    assert ops == ["addmm.default", "mm.default", "mm.default"]  # y = b + x w^T; dx = g w; dw = g^T x
    (addmm, frozen), = [k for k in log.calls if k[0] == aten.addmm.default]
    assert products.gemm_flops(addmm, frozen) == 2 * 6 * 4 * 5
    assert products.describe(addmm, frozen).split()[1:] == ["5", "6x4", "4x5(T)"]  # w^T: a transposed view


def test_replays_each_call_in_its_layout():
    q, k, v = (torch.randn(2, 2, 3, 8, requires_grad=True) for _ in range(3))
    log = products.ProductLog()
    with log:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        torch.bmm(torch.randn(3, 4, 5), torch.randn(5, 3, 2).transpose(0, 1))
    names = sorted(func.__name__ for func in {f for f, _ in log.calls})
    assert names == ["_scaled_dot_product_flash_attention_for_cpu.default",
                     "_scaled_dot_product_flash_attention_for_cpu_backward.default", "bmm.default"]
    for func, frozen in log.calls:
        assert products.best_seconds(func, frozen, seconds=0.001) > 0
        assert products.best_seconds(func, frozen, contiguous=True, seconds=0.001) > 0
    bmm = next(k for k in log.calls if k[0] == aten.bmm.default)
    assert products.gemm_flops(*bmm) == 2 * 3 * 4 * 5 * 2
    assert products.describe(*bmm).split()[1:] == ["3x4x5", "3x5x2(T)"]


@pytest.mark.parametrize("shape, strides", [((3, 4, 5), [20, 5, 1]), ((7,), [1]), ((), [])])
def test_row_major_strides(shape, strides):
    assert products._row_major(shape) == strides == list(torch.empty(shape).stride())


def test_prints_the_ceiling(capsys):
    products.main(["model=tiny", "model.N=1", "bench.synthetic=true", "bench.sentences=200", "bench.vocab_size=300",
                   "bench.max_len=30", "data.max_tokens=400", "bench.warmup=1", "bench.steps=1",
                   "bench.peak_tflops=0.5", "trainer.precision=fp32", "trainer.progress=false", "--steps", "1",
                   "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("bench: ") and "of 500 GFLOP/s" in out[1]
    assert len(out) == 3 + 3 + 2  # header lines, the top calls, the totals
    total = re.search(r"products alone: ([\d.]+) ms a step \(mm family ([\d.]+), attention kernels ([\d.]+)\)", out[-2])
    assert total and float(total[1]) == pytest.approx(float(total[2]) + float(total[3]), abs=0.11)
    ceiling = re.search(r"= ([\d.]+)% of the peak with everything else free", out[-1])
    assert ceiling and float(ceiling[1]) > 0
