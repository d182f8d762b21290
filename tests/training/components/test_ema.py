"""The weight average (trainer.ema_decay): the update rule, swapping it in and out, and that a checkpoint
holding one decodes with it."""
import torch

from tests.helpers.models import copy_checkpoint
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.training.components.checkpoint import atomic_save, load_model
from transformer.training.components.ema import EMA


def tiny():
    torch.manual_seed(0)
    return Transformer.from_config(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), 12, 12, True)


def test_update_follows_the_rule_with_its_warmup():
    model = tiny()
    ema = EMA(model, decay=0.99)
    w0 = model.generator.weight.detach().clone()
    with torch.no_grad():
        model.generator.weight.add_(1.0)
    ema.update()  # first update: decay min(0.99, 2/11)
    d = 2 / 11
    assert torch.allclose(ema.shadow["generator.weight"], d * w0 + (1 - d) * (w0 + 1.0), atol=1e-6)
    assert ema.updates == 1


def test_updates_read_the_weights_in_place_without_a_state_dict_a_step(monkeypatch):
    """The average follows weights changed in place (as Adam and a resume's load change them) without asking the
    model for its state_dict every step, a walk of the whole module tree on the host."""
    model = tiny()
    ema = EMA(model, decay=0.5)
    calls = []
    monkeypatch.setattr(model, "state_dict", lambda *a, **k: calls.append(1))
    expected = ema.shadow["generator.weight"].clone()
    for step in range(1, 4):
        with torch.no_grad():
            model.generator.weight.add_(1.0)
        ema.update()
        d = min(0.5, (1 + step) / (10 + step))
        expected = d * expected + (1 - d) * model.generator.weight.detach()
    assert calls == [] and torch.allclose(ema.shadow["generator.weight"], expected, atol=1e-6)


def test_swapped_in_restores_the_trained_weights():
    model = tiny()
    ema = EMA(model, decay=0.5)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    for t in ema.shadow.values():
        t.add_(3.0)
    with ema.swapped_in():
        assert torch.allclose(model.generator.weight, trained["generator.weight"] + 3.0)
        assert model.generator.weight is model.tgt_embed.tokens.weight  # tying survives the swap
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())


def test_state_round_trip_and_checkpoint_decodes_with_the_average(tmp_path):
    model = tiny()
    ema = EMA(model, decay=0.9)
    for _ in range(3):
        with torch.no_grad():
            model.generator.weight.mul_(0.5)
        ema.update()
    other = EMA(tiny(), decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 3 and all(torch.equal(v, ema.shadow[k]) for k, v in other.shadow.items())
    ckpt = copy_checkpoint(model)
    ckpt["ema"] = ema.state_dict()
    atomic_save(ckpt, tmp_path / "c.pt")
    loaded, _, _ = load_model(tmp_path / "c.pt")
    assert torch.equal(loaded.generator.weight, ema.shadow["generator.weight"])
