"""The checks a config's types cannot express (`validate` runs them all), each error naming the full key:
`model.d_model=500: must be divisible by model.h=8`. The schemas and their defaults are in transformer/config.py."""
import importlib.util
import math
from typing import Any

from omegaconf import DictConfig

from transformer.config import ACTIVATIONS, LIBRARIES, LOSSES, TIE_EMBEDDINGS, TRACKERS, WANDB_MODES, ConfigError
from transformer.data.config import SHAPE_STEPS


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
