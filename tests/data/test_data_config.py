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


def test_wmt14_recipes_follow_the_paper(make_cfg):
    base, big = make_cfg("experiment=wmt14_base"), make_cfg("experiment=wmt14_big")
    for cfg in (base, big):
        assert (cfg.data.name, cfg.data.src_lang, cfg.data.tgt_lang) == ("wmt14", "en", "de")
        assert (cfg.data.valid_split, list(cfg.data.test_splits)) == ("newstest2013", ["newstest2014"])
        assert (cfg.tokenizer.name, cfg.tokenizer.vocab_size, cfg.model.tie_embeddings) == ("bpe", 37000, "all")
        assert (cfg.optim.warmup, cfg.trainer.label_smoothing) == (4000, 0.1)
        assert (cfg.eval.beam, cfg.eval.lenpen, cfg.eval.max_len_a, cfg.eval.max_len_b) == (4, 0.6, 1.0, 50)
        # about 25k tokens a step on 8 workers (README, "WMT14")
        assert 24000 <= cfg.data.max_tokens * 8 * cfg.trainer.accumulate <= 27000
        # on GPUs the fastest step measured (speed=compiled_graphs); trainer.micro_batch=fit, never timed on a
        # GPU, is no longer set (experimental: issue 74)
        assert (cfg.trainer.compile, cfg.trainer.cuda_graphs, cfg.trainer.micro_batch) == (True, True, "fixed")
    assert (base.model.d_model, base.model.dropout, base.trainer.max_steps, base.checkpoint.keep_last) == \
        (512, 0.1, 100000, 5)
    assert (big.model.d_model, big.model.h, big.model.dropout, big.trainer.max_steps, big.checkpoint.keep_last) == \
        (1024, 16, 0.3, 300000, 20)


def test_preprocess_config_composes_the_same_groups():
    from transformer.cli.preprocess import compose
    cfg = compose(["data=wmt14", "tokenizer=bpe", "tokenizer.vocab_size=37000", "preprocess.out_dir=x",
                   "preprocess.workers=3"])
    assert (cfg.data.name, cfg.tokenizer.vocab_size, cfg.preprocess.workers, cfg.preprocess.chunk_size) == \
        ("wmt14", 37000, 3, 10000)
    with pytest.raises(Exception, match="workerz"):
        compose(["preprocess.out_dir=x", "preprocess.workerz=3"])
