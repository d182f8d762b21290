"""Checkpoints written before the package was reorganised (tests/fixtures/checkpoint_v1_tiny.pt: a 1-layer
model trained for 150 steps on 200 Multi30k pairs by the previous layout's `transformer.train`) still load,
and decode to exactly what the old code decoded (tests/fixtures/checkpoint_v1_tiny.json, written by it)."""
import json
from pathlib import Path

import pytest
import torch

from transformer.config import EvalConfig, from_container
from transformer.decoding import translate_sentences
from transformer.model import ModelArgs
from transformer.training.components.checkpoint import load_checkpoint, load_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CKPT = FIXTURES / "checkpoint_v1_tiny.pt"


@pytest.fixture(scope="module")
def expected():
    return json.loads((FIXTURES / "checkpoint_v1_tiny.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("beam", [1, 3])
def test_old_checkpoint_translates_as_before(expected, beam):
    model, tokenizer, _ = load_model(CKPT)
    hyps = translate_sentences(model, tokenizer, expected["sentences"], EvalConfig(beam=beam, nbest=beam))
    want = expected["outputs"][f"beam{beam}"]
    assert [[h.tokens for h in n] for n in hyps] == [[h["tokens"] for h in n] for n in want]
    assert [[h.text for h in n] for n in hyps] == [[h["text"] for h in n] for n in want]
    for n, w in zip(hyps, want, strict=False):
        assert [h.score for h in n] == pytest.approx([h["score"] for h in w], abs=1e-5)


def test_old_checkpoint_config_and_args_read_with_the_new_schema():
    ckpt = load_checkpoint(CKPT)
    args = ModelArgs.from_dict(ckpt["model_args"])
    assert (args.N, args.d_model, args.src_vocab_size) == (1, 32, ckpt["model_args"]["src_vocab_size"])
    raw = torch.load(CKPT, weights_only=True)["model_args"]
    assert "N_dec" not in raw and args.N_dec == ckpt["model_args"]["N_dec"] == 1  # before model.N_dec: N each side
    cfg = from_container(ckpt["config"])
    assert cfg.model.d_model == 32 and cfg.eval.beam == 1 and cfg.data.name == "files"
