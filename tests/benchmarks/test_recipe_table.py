"""benchmarks/recipe_table.py: the search table is built from what runs wrote (validation only)."""
import json
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark

recipe_table = load_benchmark("recipe_table")


def fake_run(folder: Path, overrides, valid, test_bleu=99.0) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    records = [{"split": "train", "step": 10, "loss": 3.0}]
    for step, bleu, minutes, extra in valid:
        records.append({"split": "valid", "step": step, "val_bleu": bleu, "train_minutes": minutes, **extra})
    records.append({"split": "test", "step": valid[-1][0], "test_bleu": test_bleu})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_rows_rank_by_best_validation_and_show_time_to_levels(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    fake_run(sweep / "0", ["experiment=multi30k", "data.root=/data", "model.N=4"],
             [(500, 30.5, 10.0, {"minutes_to_val_bleu_30": 10.0}), (1000, 35.2, 21.5, {"minutes_to_val_bleu_35": 21.5}),
              (1500, 34.9, 30.1, {})])
    fake_run(sweep / "1", ["experiment=multi30k", "model.N=6"], [(500, 20.0, 12.0, {})])
    (sweep / "2").mkdir()  # a job that never validated: not a run directory yet
    assert recipe_table.main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| overrides | best val_bleu | at step | at min |")
    assert lines[0].endswith("| min to 30 | min to 35 |")
    assert lines[2] == "| `experiment=multi30k model.N=4` | 35.20 | 1000 | 21.5 | 34.90 | 1500 | 30.1 | 10.0 | 21.5 |"
    assert lines[3] == "| `experiment=multi30k model.N=6` | 20.00 | 500 | 12.0 | 20.00 | 500 | 12.0 | — | — |"
    assert "99" not in "\n".join(lines)  # test scores never enter the table


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.mkdir(), "no metrics.jsonl"),
    (lambda p: fake_run(p, [], [(1, 1.0, 1.0, {})]).joinpath("metrics.jsonl").write_text("{\n"), "line 1: not JSON"),
])
def test_bad_folders_are_one_line_errors(tmp_path, capsys, make, fragment):
    make(tmp_path / "run")
    assert recipe_table.main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and len(err.splitlines()) == 1
