"""GPU-only checks (skipped where torch sees no CUDA device): bf16 autocast, fused kernels, NCCL."""
import pytest
import torch

from tests.helpers.cli import compose_cfg
from transformer.data.copy import CopyData
from transformer.dist import DistEnv
from transformer.model import Transformer
from transformer.tasks import build_task
from transformer.training.trainer import Trainer, autocast_dtype

pytestmark = pytest.mark.gpu


def make_trainer(tmp_path, precision):
    cfg = compose_cfg("experiment=copy", "model.N=2", "data.copy.train_size=512", "data.copy.val_size=64",
                      f"trainer.precision={precision}", "trainer.progress=false")
    env = DistEnv(device=torch.device("cuda", 0))
    data = CopyData(cfg, cfg.seed, 0, 1)
    model = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
    return Trainer(cfg, env, model, data, build_task(cfg), tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_training_steps_on_gpu_reduce_the_loss(tmp_path, precision):
    t = make_trainer(tmp_path, precision)
    batches = list(t.data.train_loader(0))[:30]
    losses = [t._optimizer_step([b]) for b in batches]
    first, last = losses[0][1] / losses[0][0], losses[-1][1] / losses[-1][0]
    assert last < first
    assert all(p.is_cuda for p in t.model.parameters())


def test_auto_precision_is_bf16_where_supported():
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    assert autocast_dtype("auto", torch.device("cuda", 0)) == expected
    assert autocast_dtype("auto", torch.device("cpu")) is None


def test_flash_attention_kernel_runs_for_causal_self_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    assert torch.allclose(out.float(), ref, atol=2e-2)


def test_gpu_stats_report_memory_and_nvml_utilisation():
    from transformer.training.logs import gpu_stats

    x = torch.ones(1024, 1024, device="cuda")
    stats = gpu_stats(torch.device("cuda", 0))
    assert stats["gpu_mem_gb"] >= x.numel() * 4 / 2**30
    assert 0 <= stats["gpu_util"] <= 100  # NVML answered for the GPU torch calls cuda:0
