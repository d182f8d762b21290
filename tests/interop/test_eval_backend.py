"""eval.backend=ctranslate2 (transformer/tasks/translation.py, transformer/interop/backend.py): validation BLEU
decoded by CTranslate2 over the weights exported at that moment, equal to the torch decoder's, leaving nothing
behind; the key checked at start."""
import importlib.util
import os
import tempfile
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.export import PAIRS, SRC, tokenizer, trained_model
from tests.helpers.models import one_thread  # noqa: F401  (autouse)
from transformer import dist
from transformer.config import ConfigError, EvalConfig
from transformer.config_checks import check_eval
from transformer.tasks.translation import tune_lenpen, valid_bleu

CPU = dist.DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture
def data():
    return SimpleNamespace(valid_srcs=SRC, valid_refs=[t for _, t in PAIRS], tokenizer=tokenizer(True))


def test_validation_bleu_by_ctranslate2_equals_the_torch_decoders(data, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    model = trained_model("all", True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the per-validation export goes
    ev = EvalConfig(beam=1)
    by_torch = valid_bleu(model, data, CPU, ev)
    by_ct2 = valid_bleu(model, data, CPU, replace(ev, backend="ctranslate2"))
    assert by_ct2 == by_torch and by_torch["val_bleu"] > 50  # greedy: token-identical outputs
    assert os.listdir(tmp_path) == []  # the export is removed after decoding
    # The weights as they are at this validation, not a cached export of earlier ones.
    with torch.no_grad():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            model.generator.weight.mul_(-1.0)
            changed = valid_bleu(model, data, CPU, replace(ev, backend="ctranslate2"))
            assert changed == valid_bleu(model, data, CPU, ev) and changed["val_bleu"] < by_torch["val_bleu"]
        finally:
            model.load_state_dict(before)


def test_lenpen_tuning_decodes_by_the_backend_too(data, monkeypatch):
    pytest.importorskip("ctranslate2")
    from transformer.interop import backend

    exports = []
    real = backend.exported_decoder
    monkeypatch.setattr(backend, "exported_decoder", lambda *a, **k: exports.append(1) or real(*a, **k))
    model = trained_model("all", True)
    ev = EvalConfig(beam=2, backend="ctranslate2")
    tuned = tune_lenpen(model, data, CPU, ev, [0.6, 1.0])
    assert len(exports) == 2 and tuned == tune_lenpen(model, data, CPU, replace(ev, backend="torch"), [0.6, 1.0])


def test_the_key_is_checked_at_start(monkeypatch):
    with pytest.raises(ConfigError, match=r"eval\.backend.*must be torch or ctranslate2"):
        check_eval(EvalConfig(backend="ct2"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"eval\.backend.*pip install ctranslate2"):
        check_eval(EvalConfig(backend="ctranslate2"))
    check_eval(EvalConfig())  # the default needs nothing
