"""Bit-for-bit comparison of two checkpoints (as `transformer.training.components.checkpoint.load_checkpoint` returns
them). Imports torch only, not pytest: the Docker tier runs it inside the image."""
import torch


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    """Every tensor of the model equal: bit for bit (atol=0) or within `atol`."""
    assert a["model"].keys() == b["model"].keys()
    for k, ta in a["model"].items():
        tb = b["model"][k]
        if atol == 0:
            assert torch.equal(ta, tb), f"{k} differs: max |diff| {(ta - tb).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(ta, tb, atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def assert_same_state(a: dict, b: dict) -> None:
    """Weights, optimiser moments, schedule and trainer position all bit-identical."""
    assert_same_weights(a, b)
    assert a["trainer"]["step"] == b["trainer"]["step"]
    assert (a["trainer"]["epoch"], a["trainer"]["batch_index"]) == (b["trainer"]["epoch"], b["trainer"]["batch_index"])
    assert a["scheduler"] == b["scheduler"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for name, v in sa[i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb[i][name])), f"optimizer state {i}.{name}"
    for ra, rb in zip(a["rng"], b["rng"], strict=True):
        assert torch.equal(ra["cpu"], rb["cpu"]), "RNG states differ"
    assert ("ema" in a) == ("ema" in b)
    if "ema" in a:  # trainer.ema_decay: the weight average and its step count
        assert a["ema"]["updates"] == b["ema"]["updates"]
        for k, v in a["ema"]["shadow"].items():
            assert torch.equal(v, b["ema"]["shadow"][k]), f"weight average {k} differs"
