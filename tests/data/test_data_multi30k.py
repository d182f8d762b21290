"""Multi30k from the shared raw files (skipped where they are absent), offline: no test touches the network."""
import urllib.request

import numpy as np
import pytest

from tests.helpers.data import MULTI30K, FakeEnv, data_cfg, needs_multi30k
from transformer.data.batch import UNK
from transformer.data.translation import build_translation_data, load_split

pytestmark = needs_multi30k


def _offline_root(tmp_path, monkeypatch):
    folder = tmp_path / "root" / "multi30k"
    folder.mkdir(parents=True)
    for f in MULTI30K.glob("*.gz"):
        (folder / f.name).symlink_to(f)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("network access attempted"))
    return tmp_path


@pytest.mark.parametrize("split,n", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)])
def test_split_sizes(tmp_path, monkeypatch, split, n):
    cfg = data_cfg(_offline_root(tmp_path, monkeypatch), "multi30k")
    src, tgt = load_split(cfg, split)
    assert len(src) == len(tgt) == n
    assert all(s.strip() for s in src) and all(t.strip() for t in tgt)


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory):
    """data=multi30k, tokenizer=spacy with the default settings, built once for this module."""
    tmp = tmp_path_factory.mktemp("m30k")
    folder = tmp / "root" / "multi30k"
    folder.mkdir(parents=True)
    for f in MULTI30K.glob("*.gz"):
        (folder / f.name).symlink_to(f)
    cfg = data_cfg(tmp, "multi30k")
    return cfg, build_translation_data(cfg, FakeEnv(), tmp / "run")


@pytest.mark.slow
def test_default_build(multi30k):
    cfg, dm = multi30k
    assert (len(dm.train), len(dm.valid)) == (29000, 1014)
    assert len(dm.valid_refs) == len(dm.valid_srcs) == 1014
    assert 4 + 5000 < dm.tgt_vocab_size < dm.src_vocab_size < 4 + 10000  # German has more word forms
    assert dm.tokenizer.encode_tgt("A man plays a guitar.")[:-1].count(UNK) == 0


@pytest.mark.slow
def test_padding_share_below_ten_percent(multi30k):
    cfg, dm = multi30k
    src, tgt = dm.train.src_sizes, dm.train.tgt_sizes
    real = padded = 0
    for b in dm.train_sampler.epoch_batches(0):
        real += src[b].sum() + tgt[b].sum()
        padded += len(b) * (src[b].max() + tgt[b].max())
        assert len(b) * max(src[b].max(), tgt[b].max()) <= cfg.data.max_tokens
    assert 1 - real / padded < 0.10


@pytest.mark.slow
def test_words_only_in_val_are_unknown(multi30k):
    cfg, dm = multi30k
    train_src, _ = load_split(cfg, "train")
    train_words = {w for s in dm.tokenizer.tokenize(train_src, "de") for w in s}
    val_src, _ = load_split(cfg, "val")
    val_toks = dm.tokenizer.tokenize(val_src, "de")
    unseen = [(k, i) for k, s in enumerate(val_toks) for i, w in enumerate(s) if w not in train_words]
    assert len(unseen) > 50
    for k, i in unseen:
        assert dm.valid.src[k][i] == UNK


@pytest.mark.slow
def test_detokeniser_round_trip_on_val(multi30k):
    """Val sentences whose words are all in the vocabulary come back exactly from their ids."""
    cfg, dm = multi30k
    ok = [dm.tokenizer.decode_tgt(dm.valid.tgt[i]) == ref for i, ref in enumerate(dm.valid_refs)
          if UNK not in dm.valid.tgt[i]]
    assert len(ok) > 700 and np.mean(ok) > 0.97


@pytest.mark.slow
def test_bpe_round_trip_on_val(tmp_path, monkeypatch):
    cfg = data_cfg(_offline_root(tmp_path, monkeypatch), "multi30k", "bpe")
    dm = build_translation_data(cfg, FakeEnv(), None)
    assert dm.shared_vocab and dm.src_vocab_size == 10000
    exact = [dm.tokenizer.decode_tgt(dm.valid.tgt[i]) == ref for i, ref in enumerate(dm.valid_refs)]
    exact += [dm.tokenizer.decode_src(dm.valid.src[i]) == src for i, src in enumerate(dm.valid_srcs)]
    assert np.mean(exact) > 0.99
