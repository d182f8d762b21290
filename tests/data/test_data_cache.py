"""The preprocessing cache (a preprocessed folder made on the fly, keyed by everything that changes the ids)
and who builds it."""
import json

import pytest

from tests.helpers.data import TRAIN_EN, FakeEnv, small_files_cfg, write_lines
from transformer.data import translation
from transformer.data.store import MANIFEST, Preprocessed, Staging
from transformer.data.translation import build_translation_data, prepare


def _forbid_building(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the data was preprocessed again")
    monkeypatch.setattr(translation, "preprocess", fail)


@pytest.fixture
def cfg(tmp_path):
    return small_files_cfg(tmp_path)


def test_second_build_only_loads(cfg, monkeypatch):
    first = build_translation_data(cfg, FakeEnv(), None)
    _forbid_building(monkeypatch)
    second = build_translation_data(cfg, FakeEnv(), None)
    assert [list(second.train.src[i]) for i in range(len(second.train))] == \
        [list(first.train.src[i]) for i in range(len(first.train))]
    assert second.tokenizer.state_dict() == first.tokenizer.state_dict()
    assert second.valid_refs == first.valid_refs


@pytest.mark.parametrize("change", ["max_len", "min_freq", "tokenizer", "direction", "content", "bad_pairs"])
def test_key_changes_with_what_changes_the_ids(cfg, change):
    before, key = prepare(cfg, progress=False)
    if change == "max_len":
        cfg.data.max_len = 100
    elif change == "min_freq":
        cfg.tokenizer.min_freq = 2
    elif change == "tokenizer":
        cfg.tokenizer.name = "bpe"
    elif change == "direction":
        cfg.data.src_lang, cfg.data.tgt_lang = "en", "de"
    elif change == "bad_pairs":
        cfg.data.bad_pairs = "error"
    else:
        write_lines(translation.Path(cfg.data.files.train + ".en"), TRAIN_EN[::-1])
    after, new_key = prepare(cfg, progress=False)
    assert new_key != key and (after / MANIFEST).is_file() and (before / MANIFEST).is_file()


def test_key_ignores_what_does_not_change_the_ids(cfg):
    _, key = prepare(cfg, progress=False)
    cfg.data.max_tokens, cfg.seed, cfg.tokenizer.vocab_size = 77, 99, 5  # batching / bpe-only settings
    assert prepare(cfg, progress=False)[1] == key


def test_bpe_key_follows_the_seed_that_draws_its_sample(cfg):
    identities = {"train": ["a", "b"], "valid": ["c", "d"]}
    cfg.tokenizer.name = "bpe"
    key = translation._cache_key(cfg, identities)
    cfg.seed += 1
    assert translation._cache_key(cfg, identities) != key


def test_atomic_layout_and_lost_race(cfg):
    folder, _ = prepare(cfg, progress=False)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left behind
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "train.src.offsets.npy", "train.src.tokens.npy", "train.tgt.offsets.npy",
        "train.tgt.tokens.npy", "valid.src.offsets.npy", "valid.src.tokens.npy", "valid.text.jsonl",
        "valid.tgt.offsets.npy", "valid.tgt.tokens.npy"]
    before = (folder / MANIFEST).read_bytes()
    # A second writer of the same key (another node racing) must neither fail nor corrupt the entry.
    late = Staging(folder.parent / "other")
    late.dest = folder
    (late.folder / "x.npy").write_bytes(b"late")
    assert late.commit({"src_lang": "de"}) == folder
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert (folder / MANIFEST).read_bytes() == before
    Preprocessed(folder)  # still verifies


def test_unwritable_cache_dir_is_a_clear_error(cfg, tmp_path):
    (tmp_path / "file").write_text("x")
    cfg.data.cache_dir = str(tmp_path / "file" / "cache")
    with pytest.raises(ValueError, match="cannot create the preprocessing cache folder .*data.cache_dir"):
        prepare(cfg, progress=False)


def test_rank0_builds_before_the_barrier_and_saves_run_files(cfg, tmp_path):
    env = FakeEnv(rank=0, world_size=2)
    dm = build_translation_data(cfg, env, tmp_path / "run")
    assert env.events == ["barrier", "broadcast"]
    assert (tmp_path / "run" / "tokenizer.json").exists()
    assert dm.train_sampler.world_size == 2 and dm.train_sampler.rank == 0


def _rank0_payload(cfg):
    folder, key = prepare(cfg, progress=False)
    state = json.loads((folder / MANIFEST).read_text())["tokenizer"]
    return folder, key, state


def test_other_ranks_wait_then_load_rank0s_entry(cfg, tmp_path, monkeypatch):
    folder, key, state = _rank0_payload(cfg)
    _forbid_building(monkeypatch)
    monkeypatch.setattr(translation, "prepare", lambda *a, **k: pytest.fail("rank 1 prepared the data"))
    env = FakeEnv(rank=1, world_size=2, from_rank0=("ok", str(folder), key, state))
    dm = build_translation_data(cfg, env, tmp_path / "run")
    assert env.events == ["barrier", "broadcast"]
    assert not (tmp_path / "run").exists()  # only rank 0 writes run files
    assert dm.train_sampler.rank == 1 and len(dm.train) == len(TRAIN_EN)


def test_rank_without_shared_filesystem_rebuilds_with_rank0s_tokenizer(cfg, tmp_path, monkeypatch):
    folder, key, state = _rank0_payload(cfg)
    cfg.data.cache_dir = str(tmp_path / "node2-cache")
    real = translation.preprocess

    def with_rank0s_tokenizer(*args, **kwargs):
        assert kwargs["tokenizer_state"] == state  # rank 0's vocabulary, not one trained here
        return real(*args, **kwargs)
    monkeypatch.setattr(translation, "preprocess", with_rank0s_tokenizer)
    dm = build_translation_data(cfg, FakeEnv(rank=1, world_size=2, from_rank0=("ok", str(folder), key, state)), None)
    assert dm.tokenizer.state_dict() == state
    assert (tmp_path / "node2-cache" / folder.name / MANIFEST).exists()
    cfg.data.files.train = cfg.data.files.val  # different files on this node: refused, nothing built
    cfg.data.cache_dir = str(tmp_path / "node3-cache")
    with pytest.raises(RuntimeError, match="cache key mismatch"):
        build_translation_data(cfg, FakeEnv(rank=1, world_size=2, from_rank0=("ok", str(folder), key, state)), None)
    assert not (tmp_path / "node3-cache").exists() or not any((tmp_path / "node3-cache").iterdir())


def test_rank0_failure_reaches_every_rank(cfg):
    cfg.data.files.train = "/nonexistent/train"
    env0 = FakeEnv(rank=0, world_size=2)
    with pytest.raises(ValueError, match="corpus file not found"):
        build_translation_data(cfg, env0, None)
    assert env0.events == ["barrier", "broadcast"]  # the others are released, not left at the barrier
    # Bad input: the same error on every rank. Anything else: a RuntimeError that names rank 0's.
    env1 = FakeEnv(rank=1, world_size=2, from_rank0=("error", "ValueError", "corpus file not found: x"))
    with pytest.raises(ValueError, match="^corpus file not found: x$"):
        build_translation_data(cfg, env1, None)
    env1 = FakeEnv(rank=1, world_size=2, from_rank0=("error", None, "MemoryError: out of memory"))
    with pytest.raises(RuntimeError, match="rank 0 failed to prepare the data: MemoryError: out of memory"):
        build_translation_data(cfg, env1, None)
