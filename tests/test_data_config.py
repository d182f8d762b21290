"""conf/data/{multi30k,files}.yaml and conf/tokenizer/*.yaml compose into the typed schema."""
import pytest
from omegaconf.errors import MissingMandatoryValue


def test_multi30k_and_bpe_compose(make_cfg):
    cfg = make_cfg("data=multi30k", "tokenizer=bpe", "data.src_lang=en", "data.tgt_lang=de")
    assert cfg.data.name == "multi30k" and cfg.data.url.startswith("https://")
    assert "test_2016_flickr" in cfg.data.test_splits
    assert (cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.max_tokens) == ("en", "de", 4096)
    assert cfg.tokenizer.name == "bpe" and cfg.tokenizer.vocab_size == 10000


def test_spacy_defaults(make_cfg):
    cfg = make_cfg("data=multi30k", "tokenizer=spacy")
    assert (cfg.tokenizer.name, cfg.tokenizer.min_freq, cfg.tokenizer.lowercase) == ("spacy", 2, False)


def test_files_needs_train_and_val(make_cfg):
    cfg = make_cfg("data=files")
    with pytest.raises(MissingMandatoryValue, match="data.files.train"):
        _ = cfg.data.files.train
    cfg = make_cfg("data=files", "data.files.train=/c/train", "data.files.val=/c/dev", "+data.files.test=/c/test",
                   "data.test_splits=[test]")
    assert dict(cfg.data.files) == {"train": "/c/train", "val": "/c/dev", "test": "/c/test"}


def test_typo_in_data_key_fails(make_cfg):
    with pytest.raises(Exception, match="max_tokenz"):
        make_cfg("data=multi30k", "data.max_tokenz=1")
