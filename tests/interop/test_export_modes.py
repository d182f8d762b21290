"""Exported folders are readable by others as the umask allows: they are built in a temporary folder and renamed
into place, and `tempfile.mkdtemp` would have made them 0700 (another user, or a container running as another
uid, could not read them)."""
import os
import stat

import pytest
import torch

from tests.helpers.export import checkpoint, tokenizer
from transformer.config import ModelConfig
from transformer.model import Transformer

pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")
from transformer.interop.ct2 import export_ct2  # noqa: E402
from transformer.interop.hf import export_hf  # noqa: E402


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_exported_folders_get_the_umasks_mode(tmp_path, umask_002):
    tok = tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=32)
    model = Transformer.from_config(cfg, tok.src_vocab_size, tok.tgt_vocab_size, shared_vocab=True).eval()
    export_hf(model, tok, checkpoint(model, tok), tmp_path / "hf")
    export_ct2(model, tok, tmp_path / "ct2")
    for name in ("hf", "ct2"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o775, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "hf"]  # no temporary folder left
