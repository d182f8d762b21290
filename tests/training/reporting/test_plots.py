"""transformer-plot and log_figures: curves from metrics.jsonl (tolerating junk), attention heatmaps."""
import json

import pytest
import torch

from tests.helpers.models import copy_checkpoint, one_thread  # noqa: F401
from transformer.cli.plot import main
from transformer.config import EvalConfig, ModelConfig
from transformer.data.copy import CopyTokenizer
from transformer.model import Transformer
from transformer.training.components.checkpoint import atomic_save
from transformer.training.reporting.plots import (
    attention_maps,
    close_figures,
    heads_figure,
    log_figures,
    loss_figure,
    read_metrics,
    series,
)

PNG = b"\x89PNG\r\n\x1a\n"


def write_metrics(path):
    lines = []
    for step in range(10, 210, 10):
        lines.append(json.dumps({"split": "train", "step": step, "loss": 5.0 / step ** 0.3,
                                 "lr": 1e-3 * min(1, step / 50)}))
        if step % 50 == 0:
            lines.append(json.dumps({"split": "valid", "step": step, "val_loss": 4.0 / step ** 0.3,
                                     "val_bleu": step / 10}))
    lines.append(json.dumps({"split": "train", "step": 210}))  # missing keys
    lines.append(json.dumps({"split": "test", "step": 200, "test_bleu": 20.0}))
    lines.append('{"split": "train", "step": 220, "lo')  # a line cut by a crash
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture
def run_dir(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl")
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0), 12, 12, shared_vocab=True)
    atomic_save(copy_checkpoint(model), tmp_path / "checkpoints" / "last.pt")
    return tmp_path


def test_read_metrics_skips_bad_lines_and_missing_keys(run_dir):
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 20 + 4 + 2
    steps, losses = series(records, "train", "loss")
    assert steps == list(range(10, 210, 10)) and len(losses) == 20
    assert series(records, "valid", "val_bleu")[0] == [50, 100, 150, 200]


def test_plot_command_writes_nonempty_pngs(run_dir, capsys):
    assert main([str(run_dir), "--sentence", "4 5 6 7"]) == 0
    names = {p.name for p in (run_dir / "plots").iterdir()}
    expected = {"loss.png", "scores.png", "lr.png"}
    expected |= {f"attention_{k}_layer{i}.png" for k in ("encoder", "decoder", "cross") for i in (1, 2)}
    assert names == expected
    for name in names:
        data = (run_dir / "plots" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
    assert capsys.readouterr().out.count(".png") == len(expected)


def test_attention_maps_are_distributions_of_the_right_shape(run_dir):
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0), 12, 12, shared_vocab=True)
    src, tgt, maps = attention_maps(model, CopyTokenizer(12), "4 5 6 7", EvalConfig(max_len_a=0, max_len_b=3))
    S, T = len(src), len(tgt)
    assert src == ["4", "5", "6", "7", "</s>"] and tgt[0] == "<s>" and T <= 4
    assert maps["encoder"][0].shape == (4, S, S) and maps["cross"][1].shape == (4, T, S)
    dec = maps["decoder"][0]
    assert dec.shape == (4, T, T) and torch.allclose(dec.sum(-1), torch.ones(4, T))
    assert torch.all(dec.triu(1) == 0)  # causal: no position sees a later one


def test_log_figures_adds_images_to_tensorboard(run_dir, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from transformer.training.reporting.plots import read_metrics as rm

    writer = SummaryWriter(str(tmp_path / "tb"))
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0), 12, 12, shared_vocab=True)
    tags = log_figures(writer, rm(run_dir / "metrics.jsonl"), model=model, tokenizer=CopyTokenizer(12),
                       sentence="4 5", step=200)
    writer.close()
    assert set(tags) == {"plots/loss", "plots/scores", "plots/lr", "plots/attention_encoder_layer1",
                         "plots/attention_decoder_layer1", "plots/attention_cross_layer1"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["images"]) == set(tags)


def test_nothing_to_plot_is_an_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_deep_model_keeps_few_figures_open(run_dir, tmp_path, monkeypatch):
    """27 figures for an 8-layer model: drawn one at a time, so matplotlib never warns about >20 open
    figures and nothing stays open afterwards (the trainer draws these at the end of every run)."""
    import matplotlib.pyplot as plt

    from transformer.training.reporting import plots

    most_open = []
    real_heads_figure = plots.heads_figure

    def counting(*args, **kw):
        fig = real_heads_figure(*args, **kw)
        most_open.append(len(plt.get_fignums()))
        return fig

    monkeypatch.setattr(plots, "heads_figure", counting)
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=8, d_model=16, d_ff=32, h=1, dropout=0.0), 12, 12, shared_vocab=True)
    paths = plots.save_figures(plots.chain(plots.curve_figures(read_metrics(run_dir / "metrics.jsonl")).items(),
                                           plots.attention_figures(model, CopyTokenizer(12), "4 5")),
                               tmp_path / "png")
    assert len(paths) == 3 + 3 * 8 and len(most_open) == 3 * 8
    assert max(most_open) == 1 and plt.get_fignums() == []


def test_validation_loss_of_older_runs_is_plotted_too():
    """Runs written before `val_loss` existed logged validation's loss as `loss`: the loss figure still has a
    validation line for them."""
    records = [{"split": "train", "step": s, "loss": 3.0 / s} for s in (1, 2, 3)]
    records += [{"split": "valid", "step": 3, "loss": 1.5}]
    fig = loss_figure(records)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["train", "valid"] and list(fig.axes[0].get_lines()[1].get_ydata()) == [1.5]
    close_figures([fig])


def test_a_heads_grid_blanks_the_cells_without_a_head():
    """h=5 heads in a grid four wide: two rows, the three cells after the last head drawn empty."""
    weights = torch.rand(5, 3, 4).softmax(-1)  # (h, T, S)
    fig = heads_figure(weights, ["a", "b", "c"], ["w", "x", "y", "z"], "heads")
    shown = [ax.axison for ax in fig.axes]
    close_figures([fig])
    assert len(shown) == 8 and shown == [True] * 5 + [False] * 3


def test_a_sentence_without_a_checkpoint_is_refused_and_leaves_no_figure_open(tmp_path, capsys):
    import matplotlib.pyplot as plt

    write_metrics(tmp_path / "metrics.jsonl")  # curves to draw, but no checkpoints/
    open_before = plt.get_fignums()
    assert main([str(tmp_path), "--sentence", "4 5 6"]) == 2
    assert "--sentence needs a checkpoint" in capsys.readouterr().err
    assert plt.get_fignums() == open_before and not (tmp_path / "plots").exists()
