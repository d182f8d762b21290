"""The preprocessed-folder format: .npy files written by appending, smallest dtypes, and refusal of folders
that are unfinished, truncated or altered (one error naming the file)."""
import json

import numpy as np
import pytest

from tests.helpers.data import small_files_cfg
from transformer.data.preprocess import Options
from transformer.data.store import MANIFEST, NpyWriter, Preprocessed, PreprocessedError, Staging, token_dtype
from transformer.data.translation import preprocess_corpus


@pytest.mark.parametrize("dtype,n", [(np.uint8, 0), (np.uint16, 1), (np.int32, 1000), (np.int64, 123457)])
def test_appended_npy_loads_and_maps(tmp_path, dtype, n):
    values = np.arange(n) % 200
    w = NpyWriter(tmp_path / "a.npy", dtype)
    for part in np.array_split(values, 7):
        w.append(part)
    w.close()
    for mode in (None, "r"):
        a = np.load(tmp_path / "a.npy", mmap_mode=mode)
        assert a.dtype == dtype and a.shape == (n,) and np.array_equal(a, values)


def test_writer_refuses_ids_its_dtype_cannot_hold(tmp_path):
    w = NpyWriter(tmp_path / "a.npy", np.uint8)
    with pytest.raises(ValueError, match="out of uint8 range"):
        w.append(np.array([3, 256]))


def test_smallest_dtype_that_holds_the_vocabulary():
    assert [token_dtype(v) for v in (11, 256, 257, 37000, 65536, 65537)] == \
        [np.uint8, np.uint8, np.uint16, np.uint16, np.uint16, np.int32]


@pytest.fixture
def folder(tmp_path):
    cfg = small_files_cfg(tmp_path)
    return preprocess_corpus(cfg, tmp_path / "bin", Options(progress=False))


def test_manifest_records_counts_dtypes_tokenizer_config_and_checksums(folder):
    m = json.loads((folder / MANIFEST).read_text())
    assert m["format"] == "transformer-preprocessed" and m["version"] == 1
    assert m["splits"]["train"]["pairs"] == 8 and m["splits"]["valid"]["pairs"] == 2
    assert m["dtypes"] == {"tokens": "uint8", "offsets": "int64"}  # a tiny vocabulary
    assert m["tokenizer"]["name"] == "spacy" and m["config"]["data"]["name"] == "files"
    assert m["config"]["tokenizer"]["min_freq"] == 1 and len(m["inputs"]["train"]["sha256"]) == 2
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert sorted(m["files"]) == on_disk
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in m["files"].values())
    assert np.load(folder / "train.src.tokens.npy", mmap_mode="r").dtype == np.uint8


def test_truncated_file_is_refused_by_name(folder):
    path = folder / "train.tgt.tokens.npy"
    path.write_bytes(path.read_bytes()[:-3])
    for verify in ("size", "sha256"):
        with pytest.raises(PreprocessedError, match=r"train\.tgt\.tokens\.npy: \d+ bytes but manifest.json records"):
            Preprocessed(folder, verify=verify)


def test_altered_file_is_refused_by_name(folder):
    path = folder / "valid.src.tokens.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, one id changed
    path.write_bytes(bytes(data))
    Preprocessed(folder, verify="size")  # sizes alone cannot see it (ranks > 0 only check sizes after rank 0)
    with pytest.raises(PreprocessedError, match=r"valid\.src\.tokens\.npy: sha256 differs from manifest.json"):
        Preprocessed(folder)


def test_missing_file_and_missing_manifest(folder, tmp_path):
    (folder / "valid.text.jsonl").unlink()
    with pytest.raises(PreprocessedError, match=r"valid\.text\.jsonl: missing"):
        Preprocessed(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(PreprocessedError, match=r"manifest\.json: missing, so .* is not a finished preprocessed"):
        Preprocessed(folder)
    with pytest.raises(PreprocessedError, match="no such folder"):
        Preprocessed(tmp_path / "nope")


def test_edited_manifest_is_refused(folder):
    m = json.loads((folder / MANIFEST).read_text())
    m["splits"]["train"]["pairs"] = 9
    (folder / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PreprocessedError, match="manifest.json: its checksum does not match"):
        Preprocessed(folder)
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(PreprocessedError, match="manifest.json: unreadable"):
        Preprocessed(folder)


def test_half_written_folder_is_hidden_and_refused(tmp_path):
    """A run killed mid-way leaves only the hidden staging folder: the destination does not exist, and the
    staging folder itself (which has no manifest) is refused."""
    staging = Staging(tmp_path / "bin")
    (staging.folder / "train.src.tokens.npy").write_bytes(b"partial")
    assert not (tmp_path / "bin").exists()
    with pytest.raises(PreprocessedError, match="manifest.json: missing"):
        Preprocessed(staging.folder)


def test_existing_destination_needs_overwrite(folder):
    with pytest.raises(PreprocessedError, match=r"already exists \(preprocess.overwrite=true replaces it\)"):
        Staging(folder)
    staging = Staging(folder, overwrite=True)
    (staging.folder / "x.npy").write_bytes(b"x")
    staging.commit({"src_lang": "de"})
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "x.npy"]
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []  # old copy removed
