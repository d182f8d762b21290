"""benchmarks/split_halves.py: choose on one half of validation, score on the other; random vs even/odd halves."""
import json
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark

split_halves = load_benchmark("split_halves")

WORDS = "a dog runs across the green field while two children watch from a wooden bench nearby".split()


def references(n: int = 40):
    # Short and long sentences alternate, as in Multi30k's files.
    return [" ".join(WORDS[i % 3: i % 3 + (5 if i % 2 == 0 else 14)]) for i in range(n)]


def write_run(folder: Path, candidates: dict) -> Path:
    for label, lines in candidates.items():
        (folder / label).mkdir(parents=True)
        (folder / label / "val.hyp").write_text("".join(line + "\n" for line in lines))
    return folder


def truncated_long(refs):  # exact on the short lines, too short on the long ones
    return [r if i % 2 == 0 else " ".join(r.split()[:8]) for i, r in enumerate(refs)]


def padded_short(refs):  # exact on the long lines, too long on the short ones
    return [r + " in the park on a sunny day" if i % 2 == 0 else r for i, r in enumerate(refs)]


def test_a_better_candidate_wins_every_held_out_case(tmp_path, capsys):
    refs = references()
    (tmp_path / "val.en").write_text("\n".join(refs) + "\n")
    run = write_run(tmp_path / "run", {"a": truncated_long(refs), "exact": refs})
    assert split_halves.main([str(run), "--ref", str(tmp_path / "val.en"), "--grid", "one=a",
                              "--grid", "two=a,exact", "--splits", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["cases"], out["won"], out["lost"]) == (6, 6, 0)
    assert out["mean_diff"] > 0


def test_parity_halves_punish_the_length_that_suits_one_half():
    refs = references()
    runs = {"r": {"a": truncated_long(refs), "b": padded_short(refs)}}
    grids = [("one", ["a"]), ("two", ["a", "b"])]
    parity = split_halves.judge(refs, runs, grids, split="parity")
    # Choosing on the even (short) lines keeps a; choosing on the odd (long) lines picks b, which the even lines punish.
    assert (parity["cases"], parity["won"], parity["lost"], parity["tied"]) == (2, 0, 1, 1)
    shuffled = split_halves.judge(refs, runs, grids, split="random", n_splits=4)
    assert shuffled["cases"] == 8 and shuffled["lost"] < shuffled["cases"]


@pytest.mark.parametrize("setup, args, fragment", [
    (lambda run, refs: write_run(run, {"a": refs}), ["--grid", "one=a", "--grid", "two=a,b"], "candidate 'b'"),
    (lambda run, refs: write_run(run, {"a": refs[:-1]}), ["--grid", "one=a", "--grid", "two=a"], "39 lines"),
    (lambda run, refs: write_run(run, {"a": refs}), ["--grid", "one=a"], "exactly two"),
    (lambda run, refs: write_run(run, {"a": refs}), ["--grid", "one", "--grid", "two=a"], "NAME=LABEL"),
    (lambda run, refs: write_run(run, {"a": refs}), ["--grid", "one=a", "--grid", "two=a", "--splits", "0"],
     "--splits 0"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, setup, args, fragment):
    refs = references()
    (tmp_path / "val.en").write_text("\n".join(refs) + "\n")
    setup(tmp_path / "run", refs)
    assert split_halves.main([str(tmp_path / "run"), "--ref", str(tmp_path / "val.en"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("split_halves: ") and fragment in err and "\n" not in err
