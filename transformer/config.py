"""Structured-config schemas: the one home of every default, registered in the ConfigStore.

The files under conf/ hold only what differs from these dataclasses (a model size, a dataset, an
experiment). A typo or a wrong type in an override fails at composition with the full key, e.g.
``Key 'lrr' not in 'OptimConfig'``; transformer/config_checks.py adds the checks a type cannot express.
"""
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from transformer.data.config import DataConfig, TokenizerConfig


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
    peak_tflops: Optional[float] = None  # peak for MFU; None: a known GPU's datasheet, a CPU's torch.mm measured
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
