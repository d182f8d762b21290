"""transformer-average: fairseq average_checkpoints semantics, refusals, atomic output."""
import pytest
import torch

from tests.helpers.models import copy_checkpoint, one_thread  # noqa: F401
from transformer.cli.average import main
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.training.components.averaging import average_checkpoints
from transformer.training.components.checkpoint import atomic_save, load_checkpoint


def tiny(seed: int, d_ff: int = 64) -> Transformer:
    torch.manual_seed(seed)
    return Transformer.from_config(ModelConfig(N=1, d_model=32, d_ff=d_ff, h=2, dropout=0.0), 12, 12, shared_vocab=True)


def save_steps(folder, models, first_step=100):
    paths = []
    for i, m in enumerate(models):
        path = folder / "checkpoints" / f"step_{first_step * (i + 1):08d}.pt"
        atomic_save(copy_checkpoint(m, step=first_step * (i + 1)), path)
        paths.append(path)
    return paths


def test_identical_checkpoints_average_to_the_same_weights(tmp_path):
    m = tiny(0)
    paths = save_steps(tmp_path, [m, m, m])
    avg = average_checkpoints(paths)
    state = m.state_dict()
    assert set(avg["model"]) == set(state)
    for k, v in state.items():
        assert avg["model"][k].dtype == v.dtype and torch.equal(avg["model"][k], v), k
    assert avg["model_args"] == m.args.to_dict() and avg["tokenizer"]["name"] == "copy" and avg["config"]["eval"]


def test_run_dir_last_n_is_the_mean_of_the_newest_n(tmp_path, capsys):
    models = [tiny(s) for s in range(3)]
    save_steps(tmp_path, models)
    assert main([str(tmp_path), "--last", "2"]) == 0
    out = tmp_path / "checkpoints" / "average_last2.pt"
    avg = load_checkpoint(out)
    for k, v in models[1].state_dict().items():
        torch.testing.assert_close(avg["model"][k], (v + models[2].state_dict()[k]) / 2)
    assert avg["trainer"]["averaged_steps"] == [200, 300] and avg["trainer"]["step"] == 300
    assert "optimizer" not in avg
    # The result loads as a model on its own.
    from transformer.model import ModelArgs, Transformer
    Transformer(ModelArgs.from_dict(avg["model_args"])).load_state_dict(avg["model"])
    assert "averaged 2 checkpoints" in capsys.readouterr().out


def test_different_architectures_are_refused(tmp_path, capsys):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    atomic_save(copy_checkpoint(tiny(0)), a)
    atomic_save(copy_checkpoint(tiny(1, d_ff=128)), b)
    out = tmp_path / "avg.pt"
    assert main([str(a), str(b), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different architecture" in err[0] and "d_ff: 64 vs 128" in err[0]
    assert not out.exists()


def test_different_vocabularies_are_refused(tmp_path, capsys):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    atomic_save(copy_checkpoint(tiny(0)), a)
    other = copy_checkpoint(tiny(1))
    other["tokenizer"] = dict(other["tokenizer"], name="spacy")
    atomic_save(other, b)
    assert main([str(a), str(b), "--output", str(tmp_path / "avg.pt")]) == 2
    assert "tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["{run}", "--last", "5"], "fewer than --last 5"),
    (["{a}", "{missing}", "--output", "{out}"], "no such checkpoint file"),
    (["{a}", "{a}", "--output", "{out}"], "listed twice"),
    (["{a}", "{b}"], "--output FILE is required"),
    (["{a}", "{b}", "--output", "{a}"], "would overwrite"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, argv, message, capsys):
    a, b = save_steps(tmp_path, [tiny(0), tiny(1)])
    argv = [x.format(run=tmp_path, a=a, b=b, missing=tmp_path / "nope.pt", out=tmp_path / "o.pt") for x in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow
def test_average_last_at_the_end_of_training_equals_the_command(tmp_path):
    """checkpoint.average_last=K writes what `transformer-average RUN --last K` writes, scores it on validation
    (split "average" in metrics.jsonl) and names the best file in the end-of-run summary."""
    import json

    from tests.helpers.dist import TINY
    from tests.helpers.inprocess import call_main
    from transformer.cli import train as train_cli

    run_dir = tmp_path / "run"  # transformer-train's main() in this process: the command line without a start
    r = call_main(train_cli.main, [*TINY, "trainer.max_steps=9", "checkpoint.every_steps=1", "checkpoint.keep_last=3",
                                   "checkpoint.average_last=3", f"hydra.run.dir={run_dir}"], tmp_path,
                  prog="transformer-train")
    assert r.returncode == 0, r.stderr[-2000:]
    written = load_checkpoint(run_dir / "checkpoints" / "average_last3.pt")
    assert main([str(run_dir), "--last", "3", "--output", str(tmp_path / "cmd.pt")]) == 0
    by_command = load_checkpoint(tmp_path / "cmd.pt")
    assert written["model"].keys() == by_command["model"].keys()
    assert all(torch.equal(written["model"][k], by_command["model"][k]) for k in written["model"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    average = [rec for rec in records if rec["split"] == "average"]
    assert len(average) == 1 and average[0]["checkpoints"] == 3 and "val_accuracy" in average[0]
    assert "done: step 9" in r.stderr and "(chosen by checkpoint.best_metric" in r.stderr
