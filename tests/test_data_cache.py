"""The preprocessing cache (built once, keyed by everything that changes the ids) and who builds it."""
import json
from pathlib import Path

import pytest
from tests.helpers.data import TRAIN_EN, FakeEnv, small_files_cfg, write_lines

from transformer.data import translation
from transformer.data.cache import CacheEntry
from transformer.data.translation import build_translation_data, prepare


def _forbid_building(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")
    monkeypatch.setattr(translation, "train_tokenizer", fail)


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
    before = prepare(cfg, progress=False)
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
        write_lines(Path(cfg.data.files.train + ".en"), TRAIN_EN[::-1])
    after = prepare(cfg, progress=False)
    assert after.key != before.key and after.exists() and before.exists()


def test_key_ignores_what_does_not_change_the_ids(cfg):
    before = prepare(cfg, progress=False)
    cfg.data.max_tokens, cfg.seed, cfg.tokenizer.vocab_size = 77, 99, 5  # batching / bpe-only settings
    assert prepare(cfg, progress=False).key == before.key


def test_atomic_layout_and_lost_race(cfg, tmp_path):
    entry = prepare(cfg, progress=False)
    folder = entry.path.parent
    assert [p.name for p in folder.iterdir()] == [entry.path.name]  # no temporary folder left behind
    assert sorted(p.name for p in entry.path.iterdir()) == [
        "meta.json", "tokenizer.json", "train.src.npz", "train.tgt.npz", "valid.src.npz", "valid.tgt.npz"]
    splits, state, meta = entry.load()
    # A second writer of the same key (another node racing) must neither fail nor corrupt the entry.
    CacheEntry(folder, entry.key).write(splits, state, meta)
    assert [p.name for p in folder.iterdir()] == [entry.path.name]
    assert json.loads((entry.path / "meta.json").read_text())["key"] == entry.key


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


def test_other_ranks_wait_then_load_rank0s_entry(cfg, tmp_path, monkeypatch):
    entry = prepare(cfg, progress=False)
    state = json.loads((entry.path / "tokenizer.json").read_text())
    _forbid_building(monkeypatch)
    monkeypatch.setattr(translation, "prepare", lambda *a, **k: pytest.fail("rank 1 prepared the data"))
    env = FakeEnv(rank=1, world_size=2, from_rank0=("ok", entry.key, state))
    dm = build_translation_data(cfg, env, tmp_path / "run")
    assert env.events == ["barrier", "broadcast"]
    assert not (tmp_path / "run").exists()  # only rank 0 writes run files
    assert dm.train_sampler.rank == 1 and len(dm.train) == len(TRAIN_EN)


def test_rank_without_shared_filesystem_rebuilds_with_rank0s_tokenizer(cfg, tmp_path, monkeypatch):
    entry = prepare(cfg, progress=False)
    state = json.loads((entry.path / "tokenizer.json").read_text())
    cfg.data.cache_dir = str(tmp_path / "node2-cache")
    _forbid_building(monkeypatch)  # must reuse rank 0's vocabulary, not train its own
    dm = build_translation_data(cfg, FakeEnv(rank=1, world_size=2, from_rank0=("ok", entry.key, state)), None)
    assert dm.tokenizer.state_dict() == state
    assert (tmp_path / "node2-cache" / entry.path.name / "meta.json").exists()


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
