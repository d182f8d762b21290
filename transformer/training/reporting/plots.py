"""Figures of a run: loss, BLEU and learning rate against steps, and attention heatmaps for one sentence
(drawn into PNG files by `transformer-plot`, into TensorBoard by the trainer at the end of a run).

Curves come from RUN_DIR/metrics.jsonl (one JSON object per line with "split" and "step"; missing keys
and unreadable lines are skipped). Attention maps are drawn as in the Annotated Transformer: per layer,
one heatmap per head, for the encoder self-attention, the decoder self-attention and the
encoder-decoder (cross) attention, on the model's own greedy translation of the sentence.
`log_figures` puts the same figures into a TensorBoard SummaryWriter.
"""
import json
import math
from itertools import chain
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from transformer.atomic import atomic_open  # noqa: E402
from transformer.config import EvalConfig  # noqa: E402
from transformer.specials import BOS  # noqa: E402


def read_metrics(path) -> List[dict]:
    """The JSON objects of a metrics.jsonl file; lines that are not JSON objects (e.g. a line cut by a
    crash) are skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                records.append(rec)
    return records


def series(records: Sequence[dict], split: str, key: str) -> Tuple[List[float], List[float]]:
    """(steps, values) of `key` in the records of `split`; a step logged twice (a resumed run) keeps its
    last value."""
    points = {}
    for r in records:
        step, value = r.get("step"), r.get(key)
        if r.get("split") == split and isinstance(step, (int, float)) and isinstance(value, (int, float)):
            if math.isfinite(value):
                points[step] = value
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _figure(title: str, ylabel: str, lines, xlabel: str = "step"):
    lines = [(label, xs, ys, style) for label, xs, ys, style in lines if xs]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys, style in lines:
        ax.plot(xs, ys, style, label=label, markersize=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def loss_figure(records):
    """Training and validation loss (label-smoothed cross-entropy per target token) against steps."""
    valid = series(records, "valid", "val_loss")
    if not valid[0]:
        valid = series(records, "valid", "loss")
    return _figure("Loss", "loss per token",
                   [("train", *series(records, "train", "loss"), "-"), ("valid", *valid, "o-")])


def score_figure(records):
    """Validation BLEU and chrF (translation) or exact-match accuracy in % (copy task) against steps."""
    lines = [("val BLEU", *series(records, "valid", "val_bleu"), "o-"),
             ("val chrF", *series(records, "valid", "val_chrf"), "s--")]
    steps, acc = series(records, "valid", "val_accuracy")
    lines.append(("val accuracy (%)", steps, [100 * a for a in acc], "^-"))
    return _figure("Validation scores", "score", lines)


def time_figure(records):
    """Validation BLEU (or accuracy, in %) against the run's wall minutes (`train_minutes`, training and
    validation summed over resumes): time to quality."""
    by_step = {r.get("step"): r.get("train_minutes") for r in records if r.get("split") == "valid"}
    lines = []
    for label, key, scale in (("val BLEU", "val_bleu", 1), ("val accuracy (%)", "val_accuracy", 100)):
        steps, values = series(records, "valid", key)
        points = [(by_step[s], v * scale) for s, v in zip(steps, values, strict=False)
                  if isinstance(by_step.get(s), (int, float))]
        lines.append((label, [m for m, _ in points], [v for _, v in points], "o-"))
    return _figure("Time to quality", "score", lines, xlabel="wall minutes")


def lr_figure(records, cfg: Optional[dict] = None):
    """Learning rate logged during training, and Equation (3) of the paper from the run's config."""
    lines = [("logged", *series(records, "train", "lr"), ".")]
    if cfg and "model" in cfg and "optim" in cfg:
        from transformer.training.components.optim import noam_lr

        last = max([r["step"] for r in records if isinstance(r.get("step"), (int, float))] or [0])
        end = int(max(last, (cfg.get("trainer") or {}).get("max_steps") or 0, 2 * cfg["optim"]["warmup"]))
        steps = list(range(1, end + 1, max(1, end // 1000)))
        d_model, warmup, factor = cfg["model"]["d_model"], cfg["optim"]["warmup"], cfg["optim"]["factor"]
        lines.append((f"schedule (d_model={d_model}, warmup={warmup}, factor={factor})", steps,
                      [noam_lr(s, d_model, warmup, factor) for s in steps], "-"))
    return _figure("Learning rate", "learning rate", lines)


def curve_figures(records, cfg: Optional[dict] = None) -> Dict[str, object]:
    figs = {"loss": loss_figure(records), "scores": score_figure(records), "time": time_figure(records),
            "lr": lr_figure(records, cfg)}
    return {name: fig for name, fig in figs.items() if fig is not None}


def _labels(tokenizer, ids: Sequence[int], side: str) -> List[str]:
    fn = getattr(tokenizer, f"{side}_tokens", None)
    return list(fn(ids)) if fn is not None else [str(int(i)) for i in ids]


@torch.no_grad()
def attention_maps(model, tokenizer, sentence: str, ev: Optional[EvalConfig] = None):
    """Greedy translation of `sentence` (output limit from the EvalConfig `ev`, default: the schema's) and the
    attention weights of every layer on it:
    (src labels, tgt labels, {"encoder": [(h, S, S)] * N, "decoder": [(h, T, T)] * N, "cross": [(h, T, S)] * N})."""
    from transformer.decoding import encode_batch, greedy_decode

    ev = ev or EvalConfig()
    device = next(model.parameters()).device
    src_ids = list(tokenizer.encode_src(sentence))
    src = encode_batch([src_ids], device)  # (1, S)
    hyp = greedy_decode(model, src, ev.max_len_a, ev.max_len_b)[0]
    tgt_in = torch.tensor([[BOS] + hyp], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    model.record_attention(True)
    try:
        model(src, tgt_in)
        maps = {"encoder": [layer.self_attn.last_attention[0].float().cpu() for layer in model.encoder],
                "decoder": [layer.self_attn.last_attention[0].float().cpu() for layer in model.decoder],
                "cross": [layer.cross_attn.last_attention[0].float().cpu() for layer in model.decoder]}
    finally:
        model.record_attention(False)
        model.train(was_training)
    src_labels = _labels(tokenizer, src_ids, "src") + ["</s>"]
    tgt_labels = ["<s>"] + _labels(tokenizer, hyp, "tgt")
    return src_labels, tgt_labels, maps


def heads_figure(weights: torch.Tensor, rows: List[str], cols: List[str], title: str):
    """weights (h, T, S): one heatmap per head in a grid, queries down, keys across."""
    h = weights.size(0)
    ncols = min(4, h)
    nrows = math.ceil(h / ncols)
    size = max(2.5, 0.22 * max(len(rows), len(cols)))
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        ax.imshow(weights[i].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {i + 1}", fontsize=9)
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels(cols, rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def attention_figures(model, tokenizer, sentence: str,
                      ev: Optional[EvalConfig] = None) -> Iterator[Tuple[str, object]]:
    """("attention_encoder_layer1", Figure), ...: every layer of the three attention kinds. A generator, so
    a consumer that closes each figure keeps one open at a time (a big model has dozens of layers)."""
    src, tgt, maps = attention_maps(model, tokenizer, sentence, ev)
    for kind, rows, cols, what in (("encoder", src, src, "Encoder self-attention"),
                                   ("decoder", tgt, tgt, "Decoder self-attention"),
                                   ("cross", tgt, src, "Encoder-decoder attention")):
        for i, w in enumerate(maps[kind]):
            yield f"attention_{kind}_layer{i + 1}", heads_figure(w, rows, cols, f"{what}, layer {i + 1}")


def save_figures(figs: Iterable[Tuple[str, object]], out_dir: Path) -> List[Path]:
    """NAME.png for each (NAME, figure), each written atomically and closed before the next is drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs:
        path = out_dir / f"{name}.png"
        try:
            with atomic_open(path, "wb") as f:
                fig.savefig(f, format="png", dpi=100)
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def log_figures(writer, records: Optional[Sequence[dict]] = None, run_dir=None, cfg: Optional[dict] = None,
                model=None, tokenizer=None, sentence: Optional[str] = None, step: Optional[int] = None,
                ev=None) -> List[str]:
    """Adds the curve figures (from `records`, or RUN_DIR/metrics.jsonl) and, with model, tokenizer and
    sentence (and `ev`, the EvalConfig bounding its translation), the attention maps to a TensorBoard
    SummaryWriter as images under "plots/NAME". Returns
    the tags written. Call on rank 0 only."""
    if records is None and run_dir is not None and (Path(run_dir) / "metrics.jsonl").is_file():
        records = read_metrics(Path(run_dir) / "metrics.jsonl")
    figs = curve_figures(records or [], cfg).items()
    if model is not None and tokenizer is not None and sentence:
        figs = chain(figs, attention_figures(model, tokenizer, sentence, ev))
    tags = []
    for name, fig in figs:
        writer.add_figure(f"plots/{name}", fig, global_step=step, close=True)
        tags.append(f"plots/{name}")
    return tags


def close_figures(figs) -> None:
    for fig in figs:
        plt.close(fig)
