"""Structured-config schemas: the one home of every default, registered in the ConfigStore.

The files under conf/ hold only what differs from these dataclasses (a model size, a dataset, an
experiment). A typo or a wrong type in an override fails at composition with the full key, e.g.
``Key 'lrr' not in 'OptimConfig'``; the `check_*` functions beside the schemas add the checks a type
cannot express, and `validate()` runs them all.
"""
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from transformer.data.config import SHAPE_STEPS, DataConfig, TokenizerConfig


def conf_dir(package: Path) -> Path:
    """The recipes and groups: `package`/conf in an installed wheel (setup.py copies the clone's conf/ there),
    else the clone's top-level conf/, read in place by an editable install (an edit counts at once)."""
    packaged = package / "conf"
    return packaged if packaged.is_dir() else package.parent / "conf"


# An absolute path: Hydra reads a relative config_path as a Python package, which fails outside the repository.
CONF_DIR = conf_dir(Path(__file__).resolve().parent)
TIE_EMBEDDINGS = ("none", "decoder", "all")
ACTIVATIONS = ("relu", "swish", "gelu")


class ConfigError(ValueError):
    """A config value that composes but makes no sense; the message names the full key."""


@dataclass
class ModelConfig:
    """Section 3 of the paper; `base` and `big` are Table 3's rows."""
    N: int = 6  # layers in each of the encoder and decoder stacks
    N_dec: Optional[int] = None  # decoder layers when they differ from N (a deep encoder and a shallow decoder)
    d_model: int = 512  # width of every sublayer's output and of the embeddings
    d_ff: int = 2048  # inner width of the position-wise feed-forward network (Section 3.3)
    h: int = 8  # attention heads; d_k = d_v = d_model / h
    dropout: float = 0.1  # P_drop
    # Dropout on the attention weights; null: model.dropout (as before the key). Section 5.4 drops sublayer outputs
    # and embeddings only, so model=base and big set 0 (tensor2tensor's v2 and the Annotated Transformer add this
    # one). At 0, attention needs no random mask, and trainer.unpadded_attention runs torch's varlen kernel.
    attention_dropout: Optional[float] = None
    # Dropout inside the feed-forward network, after the activation; null: model.dropout (as before the key).
    # Section 5.4 has none there either, so model=base and big set 0 (tensor2tensor's v2 relu_dropout, the
    # Annotated Transformer's): at 0, one kernel less forward and backward per layer (docs/performance.md).
    ffn_dropout: Optional[float] = None
    norm_first: bool = False  # False: post-norm as in the paper; True: pre-norm (Annotated Transformer)
    tie_embeddings: str = "decoder"  # none | decoder | all (all needs one shared vocabulary)
    max_positions: int = 1024  # rows of the sinusoidal position table: the longest sequence the model takes
    activation: str = "relu"  # feed-forward nonlinearity: relu (the paper) | swish | gelu (released Marian models)
    output_bias: bool = False  # a bias on the pre-softmax linear layer (released Marian models have one)


@dataclass
class OptimConfig:
    """Section 5.3: Adam with the warmup-then-inverse-square-root ("Noam") rate."""
    name: str = "adam_noam"  # the only optimiser: Adam with the Noam rate below
    factor: float = 1.0  # rate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup: int = 4000  # optimiser steps, not micro-batches
    beta1: float = 0.9  # Adam's beta_1 (Section 5.3)
    beta2: float = 0.98  # Adam's beta_2
    eps: float = 1e-9  # Adam's epsilon
    weight_decay: float = 0.0  # L2 penalty added to the gradient (Adam's weight_decay); 0 = none, as in the paper
    anneal: float = 0.0  # the run's last fraction (of max_steps, or of max_minutes): the rate falls linearly to 0


LOSSES = ("auto", "fused", "compiled", "reference")  # trainer.loss: transformer/training/components/loss.py


@dataclass
class TrainerConfig:
    """The training loop: its length, batches per step, devices, precision, resume and speed switches."""
    max_steps: Optional[int] = None  # optimiser steps; None = no limit
    max_epochs: Optional[int] = 20  # passes over the training split; None = no limit
    max_minutes: Optional[float] = None  # wall minutes of training and validation, over resumes; then a normal end
    accumulate: int = 1  # micro-batches per optimiser step
    clip_norm: Optional[float] = None  # clip the gradient's global L2 norm to this; None = no clipping
    label_smoothing: float = 0.1  # Section 5.4
    # A step whose loss or gradients are not finite (inf/NaN): skip = its update is skipped (on the device), and
    # the run stops (exit code 4) after more than nonfinite_skips such steps in a row; stop = it stops at the first.
    nonfinite: str = "skip"
    nonfinite_skips: int = 10  # non-finite steps in a row that trainer.nonfinite=skip tolerates before it stops
    val_every: int = 1000  # steps; validation also runs at every epoch end, unless val_epoch_end is false
    val_epoch_end: bool = True  # false: an epoch end is neither validated nor checkpointed
    log_every: int = 50  # steps between logged training lines (metrics.jsonl, TensorBoard, console)
    devices: str = "auto"  # auto | N: workers spawned by this process (ignored under torchrun)
    accelerator: str = "auto"  # auto | cpu | gpu
    # auto (bf16 where the GPU or CPU has bf16 units, else fp32) | fp32 | bf16 | fp16 | fp8 (the Linear layers' products
    # in float8, the rest bf16: NVIDIA GPUs of compute capability >= 8.9, with the fp8 extra, torchao)
    precision: str = "auto"
    resume: str = "auto"  # auto (last good checkpoint of the run directory) | none | PATH
    init_from: Optional[str] = None  # checkpoint whose weights only start a new run
    deterministic: bool = False  # torch's deterministic algorithms (bit-exact GPU resume; slower)
    timeout_s: int = 600  # process-group timeout: a dead peer fails the job after this long
    compile: bool = False  # torch.compile the model
    compile_scope: str = "model"  # what trainer.compile compiles: model (one graph) | layers (experimental)
    progress: bool = True  # progress bar on rank 0
    threads: Optional[int] = None  # torch CPU threads per worker; None = the cores this process may use / local workers
    ema_decay: float = 0.0  # exponential moving average of the weights (0 = off); validation scores the average
    dropout_by_epoch: List[float] = field(default_factory=list)  # P_drop of epochs 0, 1, ...; model.dropout after
    # Speed switches (transformer/training/speed/; measured or not, docs/performance.md). The `speed` group sets
    # compile, bf16_residual, cuda_graphs (and loss) to a measured preset; a switch given after it refines it.
    tf32: bool = True  # GPUs: float32 matrix products in TF32 (no effect on bf16 autocast's products)
    keep_freed_memory: bool = True  # CPUs (glibc): freed tensor memory is reused, not handed back to the kernel
    pad_to_multiple: Optional[int] = None  # batch lengths padded up to a multiple; None: 1, no padding
    activation_checkpointing: bool = False  # recompute each layer's activations in backward: less memory
    ddp_bucket_mb: int = 25  # DDP gradient bucket size
    ddp_static_graph: bool = False  # DDP static_graph=True (the same parameters get gradients every step)
    # fused (chunked, one fp32 chunk per pass, gradient written into the logits) | compiled (the same two passes,
    # each one torch.compile'd graph over all rows) | reference (log_softmax and autograd) | auto: compiled on
    # CUDA GPUs where torch.compile can build kernels (Triton and a C compiler), except under cuda_graphs without
    # compile; fused elsewhere
    loss: str = "auto"
    bf16_residual: bool = False  # under bf16 autocast: residual stream in bf16, LayerNorm statistics in fp32
    unpadded_attention: bool = False  # experimental: training forward on the packed real tokens, varlen attention
    # fixed: data.max_tokens and trainer.accumulate as given. fit (experimental): on a CUDA GPU, before the first
    # step, the largest micro-batch that memory allows (probed), accumulate lowered to keep the tokens per update
    # (workers x accumulate x max_tokens); kept in the checkpoint, reused on resume; nothing is probed on CPUs
    micro_batch: str = "fixed"
    micro_batch_margin: float = 0.1  # fit: share of the GPU's memory left free above the probe's peak
    micro_batch_tolerance: float = 0.01  # fit: largest relative change of the tokens per update, else refused
    # Training micro-batches padded to a few fixed (rows, source, target) shapes (transformer/data/shapes.py):
    # lengths on a ladder (multiples of 4 to 32, then 4 steps an octave), rows from data.max_tokens; padding rows carry
    # no loss. Few shapes for torch.compile and CUDA graphs, at the cost of padding (transformer-bench reports it).
    # With unpadded_attention: the real tokens packed end to end, filled up to a few token budgets instead
    # (transformer/experimental/packed.py): no padding, a little filler.
    static_shapes: bool = False
    # Ladder lengths an octave (2, 4, 8 or 16): 8 halves the ladder's padding (multiples of 2 to 32, then 8 steps an
    # octave) for about twice the shapes, each a CUDA graph captured once (benchmarks/bench_shapes.py counts both).
    shape_steps: int = 4
    # CUDA: each static shape's forward+backward and the update replayed as CUDA graphs, the gradient all-reduce
    # eager between them (transformer/training/speed/graphs.py); implies static_shapes (packed token budgets with
    # unpadded_attention). Not with fp16 or activation checkpointing.
    cuda_graphs: bool = False


@dataclass
class CheckpointConfig:
    """When checkpoints are written and kept, which one is best.pt, and the end-of-run average."""
    every_steps: int = 1000  # also written at every epoch end and on preemption
    keep_last: int = 5  # `transformer-average RUN --last 5` (the paper's base-model average) works on every run
    best_metric: str = "val_loss"  # val_loss, or a score the task measures (val_bleu, val_chrf, val_accuracy)
    average_last: int = 0  # at the end, average the last K checkpoints, score it, and make it best.pt if better


@dataclass
class EvalConfig:
    """Decoding during training and for the translate/evaluate commands."""
    beam: int = 1  # 1 = greedy
    # Beam at the validations during training; None = eval.beam. Greedy (1) decodes faster than beam 5
    # (docs/performance.md) and keeps the step on the same path (validation leaves the RNG untouched), so
    # the hour buys more steps; eval.tune_lenpen and transformer-evaluate/translate still decode with eval.beam.
    valid_beam: Optional[int] = None
    lenpen: float = 1.0  # score / length**lenpen
    max_len_a: float = 1.2  # hypotheses stop at a * source length + b tokens
    max_len_b: int = 10  # see max_len_a
    nbest: int = 1  # hypotheses printed per sentence by transformer-translate (Moses n-best format when > 1)
    # Validation BLEU's decoder: "ctranslate2" exports the weights at each validation to a temporary folder and
    # decodes with CTranslate2 on the CPU (pip install ctranslate2); translate/evaluate take --backend instead.
    backend: str = "torch"
    batch_tokens: int = 8000  # source tokens per decoding batch
    bleu: bool = True  # validation BLEU at every validation (translation data only)
    bleu_sentences: Optional[int] = None  # validate BLEU on the first N val pairs; None = all
    patience: Optional[int] = None  # early stop after this many validations without a better best_metric
    # At the end of training, validation BLEU of best.pt at each of these length penalties; the best is stored in
    # best.pt, and transformer-evaluate/translate decode with it (an explicit --lenpen wins). [] = off.
    tune_lenpen: List[float] = field(default_factory=list)


@dataclass
class BenchConfig:
    """transformer-bench (transformer/training/tools/bench.py): warm-up, then timed optimiser steps of the training
    config."""
    warmup: int = 5  # untimed steps first; with compile or CUDA graphs more, until 20 in a row add no graph
    steps: Optional[int] = None  # timed optimiser steps per repeat; None: 100 on a GPU, 20 on a CPU
    repeats: int = 3  # timed windows of `steps` each, back to back: their spread (median, min, max) is reported
    synthetic: bool = False  # random batches instead of data.*: lengths below, vocabulary vocab_size
    sentences: int = 20000  # synthetic corpus size (batched by data.max_tokens like real data)
    vocab_size: int = 32000  # synthetic source and target vocabulary (the generator's cost grows with it)
    length_mean: float = 27.0  # synthetic sentence lengths ~ normal(mean, std), clipped to [min_len, max_len];
    length_std: float = 12.0  # the target length is the source length plus normal(0, std / 4) noise
    min_len: int = 2  # shortest synthetic sentence
    max_len: int = 128  # longest synthetic sentence
    peak_tflops: Optional[float] = None  # the accelerator's peak for MFU; None: from the table of known GPUs
    profile: bool = True  # profile a few more steps (torch.profiler): device busy fraction and the top operators
    profile_steps: int = 5  # steps in the profile window
    top: int = 15  # operators listed: kernels by self device time on a GPU, ops by self CPU time on a CPU
    out: Optional[str] = None  # also append the JSON line to this file
    trace: Optional[str] = None  # also write the profile window as a trace for Perfetto (.gz: gzipped)


TRACKERS = ("tensorboard", "wandb", "mlflow")
# tracker -> (module that must be importable, pip extra that installs it)
LIBRARIES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    """logger.trackers=[...,wandb]: Weights & Biases (the `wandb` extra)."""
    project: str = "transformer"  # the W&B project the run is logged to
    entity: Optional[str] = None  # team or user; None: the account's default
    mode: Optional[str] = None  # online | offline | disabled; None: $WANDB_MODE, else online (needs a login)
    name: Optional[str] = None  # the run's display name; None: the run directory's name
    group: Optional[str] = None  # W&B run group (e.g. one sweep); None: none
    tags: List[str] = field(default_factory=list)  # W&B tags of the run


@dataclass
class MlflowConfig:
    """logger.trackers=[...,mlflow]: MLflow (the `mlflow` extra, mlflow-skinny)."""
    # None: $MLFLOW_TRACKING_URI, else file:<run_dir>/mlruns (a local file store)
    tracking_uri: Optional[str] = None
    experiment: str = "transformer"  # the MLflow experiment the run belongs to
    run_name: Optional[str] = None  # None: the run directory's name


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl and the console (transformer/training/reporting/trackers.py)."""
    trackers: List[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, wandb, mlflow
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


def check_logger(cfg_logger) -> None:
    """Names, duplicates, values, and that each chosen tracker's library imports; the error names the key."""
    chosen = list(cfg_logger.trackers)
    for name in chosen:
        if name not in TRACKERS:
            raise ConfigError(f"logger.trackers={chosen}: {name!r} is not one of {', '.join(TRACKERS)}")
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"logger.trackers={chosen}: a tracker is listed twice")
    for name in chosen:
        module, extra = LIBRARIES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"logger.trackers={chosen}: {name} needs the {module} package, which is not installed: "
                              f"pip install 'transformer[{extra}]' (from a clone: pip install -e '.[{extra}]')")
    mode = cfg_logger.wandb.mode
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={mode!r}: must be {', '.join(WANDB_MODES)} or null")


@dataclass
class Config:
    """The whole run. `model`, `data` and `tokenizer` are chosen from conf/ groups (files there hold only what
    differs from these schemas); the other sections are set by key (`trainer.max_steps=...`) or by experiments."""
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    tokenizer: TokenizerConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 1234
    bench: BenchConfig = field(default_factory=BenchConfig)  # read by transformer-bench only
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # trackers: tensorboard, wandb, mlflow


def schema_defaults() -> dict:
    """Every section's defaults as the schemas give them (the groups' schemas for model, data and tokenizer),
    as plain containers: what a key that an older config lacks would have been."""
    import dataclasses
    out = {}
    for f in dataclasses.fields(Config):
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = dataclasses.asdict(f.default_factory())
        elif f.default is not MISSING:
            out[f.name] = f.default
    for name, schema in (("model", ModelConfig), ("data", DataConfig), ("tokenizer", TokenizerConfig)):
        out[name] = dataclasses.asdict(schema())
    return out


def register_configs() -> None:
    """`conf/config.yaml` lists `config_schema` first: every group merges into its typed node."""
    ConfigStore.instance().store(name="config_schema", node=Config)


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:  # a boolean as the command line spells it (true, not True)
        raise ConfigError(f"{key}={str(value).lower() if isinstance(value, bool) else repr(value)}: {why}")


def check_model(m, key: str = "model") -> None:
    for name in ("N", "d_model", "d_ff", "h", "max_positions"):
        _check(m[name] > 0, f"{key}.{name}", m[name], "must be positive")
    _check(m.N_dec is None or m.N_dec > 0, f"{key}.N_dec", m.N_dec, "must be positive or null (= N)")
    _check(m.d_model % m.h == 0, f"{key}.d_model", m.d_model, f"must be divisible by {key}.h={m.h}")
    _check(0 <= m.dropout < 1, f"{key}.dropout", m.dropout, "must be in [0, 1)")
    _check(m.attention_dropout is None or 0 <= m.attention_dropout < 1, f"{key}.attention_dropout",
           m.attention_dropout, "must be in [0, 1), or null (= model.dropout)")
    _check(m.ffn_dropout is None or 0 <= m.ffn_dropout < 1, f"{key}.ffn_dropout", m.ffn_dropout,
           "must be in [0, 1), or null (= model.dropout)")
    _check(m.tie_embeddings in TIE_EMBEDDINGS, f"{key}.tie_embeddings", m.tie_embeddings,
           "must be " + ", ".join(TIE_EMBEDDINGS))
    _check(m.activation in ACTIVATIONS, f"{key}.activation", m.activation, "must be " + ", ".join(ACTIVATIONS))


def check_optim(o) -> None:
    _check(o.name == "adam_noam", "optim.name", o.name, "the only optimiser is adam_noam")
    _check(o.warmup > 0, "optim.warmup", o.warmup, "must be > 0")
    _check(o.factor > 0, "optim.factor", o.factor, "must be > 0")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2", (o.beta1, o.beta2), "must be in [0, 1)")
    _check(0 <= o.anneal < 1, "optim.anneal", o.anneal, "must be in [0, 1)")


def check_trainer(t) -> None:
    _check(t.accumulate >= 1, "trainer.accumulate", t.accumulate, "must be >= 1")
    _check(t.max_steps is None or t.max_steps > 0, "trainer.max_steps", t.max_steps, "must be > 0 or null")
    _check(t.max_epochs is None or t.max_epochs > 0, "trainer.max_epochs", t.max_epochs, "must be > 0 or null")
    _check(t.max_minutes is None or t.max_minutes > 0, "trainer.max_minutes", t.max_minutes, "must be > 0 or null")
    _check(t.max_steps is not None or t.max_epochs is not None or t.max_minutes is not None, "trainer.max_steps",
           t.max_steps, "set trainer.max_steps, trainer.max_epochs or trainer.max_minutes, or training never ends")
    _check(t.clip_norm is None or t.clip_norm > 0, "trainer.clip_norm", t.clip_norm, "must be > 0 or null")
    _check(0 <= t.label_smoothing < 1, "trainer.label_smoothing", t.label_smoothing, "must be in [0, 1)")
    _check(t.val_every > 0, "trainer.val_every", t.val_every, "must be > 0")
    _check(t.log_every > 0, "trainer.log_every", t.log_every, "must be > 0")
    _check(t.devices == "auto" or (t.devices.isdigit() and int(t.devices) > 0), "trainer.devices", t.devices,
           "must be auto or a positive number")
    _check(t.accelerator in ("auto", "cpu", "gpu"), "trainer.accelerator", t.accelerator, "must be auto, cpu or gpu")
    _check(t.loss in LOSSES, "trainer.loss", t.loss, f"must be one of {', '.join(LOSSES)}")
    _check(t.compile_scope in ("model", "layers"), "trainer.compile_scope", t.compile_scope,
           "must be model or layers")
    _check(t.micro_batch in ("fixed", "fit"), "trainer.micro_batch", t.micro_batch, "must be fixed or fit")
    _check(0 <= t.micro_batch_margin < 1, "trainer.micro_batch_margin", t.micro_batch_margin, "must be in [0, 1)")
    _check(0 <= t.micro_batch_tolerance < 1, "trainer.micro_batch_tolerance", t.micro_batch_tolerance,
           "must be in [0, 1)")
    _check(t.precision in ("auto", "fp32", "bf16", "fp16", "fp8"), "trainer.precision", t.precision,
           "must be auto, fp32, bf16, fp16 or fp8")
    _check(t.timeout_s > 0, "trainer.timeout_s", t.timeout_s, "must be > 0")
    _check(t.nonfinite in ("skip", "stop"), "trainer.nonfinite", t.nonfinite, "must be skip or stop")
    _check(t.nonfinite_skips >= 0, "trainer.nonfinite_skips", t.nonfinite_skips, "must be >= 0")
    _check(t.threads is None or t.threads > 0, "trainer.threads", t.threads, "must be > 0 or null")
    _check(0 <= t.ema_decay < 1, "trainer.ema_decay", t.ema_decay, "must be in [0, 1)")
    _check(all(0 <= p < 1 for p in t.dropout_by_epoch), "trainer.dropout_by_epoch", list(t.dropout_by_epoch),
           "must all be in [0, 1)")
    _check(t.pad_to_multiple is None or t.pad_to_multiple >= 1, "trainer.pad_to_multiple", t.pad_to_multiple,
           "must be >= 1 or null")
    _check(t.ddp_bucket_mb > 0, "trainer.ddp_bucket_mb", t.ddp_bucket_mb, "must be > 0")
    for key, conflict in (("activation_checkpointing", "its recomputation is not captured"),
                          ("precision", "fp16's grad scaler reads its overflow check on the host: use bf16 or fp32")):
        on = t[key] == "fp16" if key == "precision" else t[key]
        _check(not (on and t.cuda_graphs), "trainer.cuda_graphs", True,
               f"not with trainer.{key}={str(t[key]).lower()}: {conflict}")
    _check(t.shape_steps in SHAPE_STEPS, "trainer.shape_steps", t.shape_steps,
           f"must be one of {', '.join(map(str, SHAPE_STEPS))}")


def check_data(d) -> None:
    _check(d.max_tokens > 0, "data.max_tokens", d.max_tokens, "must be > 0")
    _check(all(n > 0 for n in d.max_tokens_by_epoch), "data.max_tokens_by_epoch", list(d.max_tokens_by_epoch),
           "must all be > 0")
    _check(d.max_sentences is None or d.max_sentences > 0, "data.max_sentences", d.max_sentences, "must be > 0")
    _check(d.bad_pairs in ("skip", "error"), "data.bad_pairs", d.bad_pairs, "must be skip or error")
    _check(0.0 <= d.bpe_dropout < 1.0, "data.bpe_dropout", d.bpe_dropout, "must be >= 0 and < 1")
    _check(d.bpe_dropout_samples >= 1, "data.bpe_dropout_samples", d.bpe_dropout_samples, "must be >= 1")
    _check(d.bpe_dropout_from_epoch >= 0, "data.bpe_dropout_from_epoch", d.bpe_dropout_from_epoch, "must be >= 0")
    _check(d.download_retries >= 1, "data.download_retries", d.download_retries, "must be >= 1")
    _check(d.download_timeout_s > 0, "data.download_timeout_s", d.download_timeout_s, "must be > 0")
    _check(d.download_deadline_s is None or d.download_deadline_s > 0, "data.download_deadline_s",
           d.download_deadline_s, "must be > 0 or null")


def check_checkpoint(c) -> None:
    _check(c.every_steps > 0, "checkpoint.every_steps", c.every_steps, "must be > 0")
    _check(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")
    _check(c.average_last == 0 or 2 <= c.average_last <= c.keep_last, "checkpoint.average_last", c.average_last,
           f"must be 0 (off) or between 2 and checkpoint.keep_last={c.keep_last}")


def check_eval(e, key: str = "eval") -> None:
    """Also used by the translate/evaluate commands on their EvalConfig (their messages name the flag)."""
    _check(e.beam >= 1, f"{key}.beam", e.beam, "must be >= 1")
    _check(1 <= e.nbest <= e.beam, f"{key}.nbest", e.nbest, f"must be between 1 and {key}.beam={e.beam}")
    _check(e.valid_beam is None or e.valid_beam >= 1, f"{key}.valid_beam", e.valid_beam, "must be >= 1 or null")
    _check(e.batch_tokens >= 1, f"{key}.batch_tokens", e.batch_tokens, "must be >= 1")
    _check(e.backend in ("torch", "ctranslate2"), f"{key}.backend", e.backend, "must be torch or ctranslate2")
    _check(e.backend != "ctranslate2" or importlib.util.find_spec("ctranslate2") is not None, f"{key}.backend",
           e.backend, "needs the ctranslate2 library: pip install ctranslate2")
    _check(e.max_len_a >= 0 and e.max_len_b >= 0, f"{key}.max_len_a/max_len_b", (e.max_len_a, e.max_len_b),
           "must be >= 0")
    tune = list(e.tune_lenpen)
    _check(all(math.isfinite(x) for x in tune), f"{key}.tune_lenpen", tune, "must be finite numbers")
    _check(len(set(tune)) == len(tune), f"{key}.tune_lenpen", tune, "has a value twice")
    _check(e.bleu or not tune, f"{key}.tune_lenpen", tune, "ranks by validation BLEU: needs eval.bleu=true")


def validate(cfg: DictConfig) -> None:
    """Checks a schema's types cannot express; raises ConfigError naming the full key. Whether
    checkpoint.best_metric is measured depends on the task: `transformer.tasks` checks it."""
    check_model(cfg.model)
    check_optim(cfg.optim)
    check_trainer(cfg.trainer)
    _check(cfg.optim.anneal == 0 or cfg.trainer.max_steps is not None or cfg.trainer.max_minutes is not None,
           "optim.anneal", cfg.optim.anneal, "needs the run's length: set trainer.max_steps or trainer.max_minutes")
    check_data(cfg.data)
    _check(cfg.data.bpe_dropout == 0 or cfg.tokenizer.name == "bpe", "data.bpe_dropout", cfg.data.bpe_dropout,
           f"needs tokenizer=bpe (tokenizer.name is {cfg.tokenizer.name})")
    _check(cfg.tokenizer.tgt_vocab in ("full", "seen"), "tokenizer.tgt_vocab", cfg.tokenizer.tgt_vocab,
           "must be full or seen")
    _check(cfg.data.bpe_dropout == 0 or cfg.tokenizer.tgt_vocab == "full", "tokenizer.tgt_vocab",
           cfg.tokenizer.tgt_vocab, "must be full with data.bpe_dropout > 0 (its pieces include types no plain "
           "target uses)")
    check_checkpoint(cfg.checkpoint)
    check_eval(cfg.eval)
    check_logger(cfg.logger)


def eval_from_dict(saved: Optional[dict]) -> EvalConfig:
    """An EvalConfig from a checkpoint's saved `eval` section (keys unknown to this version are ignored)."""
    return EvalConfig(**{k: v for k, v in (saved or {}).items() if k in EvalConfig.__dataclass_fields__})


def to_container(cfg: DictConfig) -> dict:
    """Plain, resolved dict (safe for `torch.load(weights_only=True)` and for pickling to spawned workers)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def from_container(d: dict) -> DictConfig:
    """Rebuild a typed config from `to_container`'s output (spawned workers, checkpoints)."""
    d = {k: v for k, v in d.items() if k != "hydra"}
    cfg = OmegaConf.merge(OmegaConf.structured(Config), d)
    OmegaConf.set_struct(cfg, True)
    return cfg
