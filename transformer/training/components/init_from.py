"""trainer.init_from: a new run that starts from a trained model keeps that model's vocabulary.

The weights' embedding rows and output logits mean the tokens of the tokenizer they were trained with, so a
fine-tuning run on another corpus encodes it with the checkpoint's tokenizer (its saved state), never a newly
learnt one: the same word gets the same id. A config whose tokenizer settings differ from those the checkpoint
was trained with asks for another vocabulary, which the weights cannot use: refused with one line naming both.

`read_init_from` is the one place where init_from's source is read; a reader of another format (a Hugging Face
folder, say) returns the same `InitFrom`.
"""
from dataclasses import dataclass, field
from typing import Optional

from transformer.config import ConfigError, to_container
from transformer.data.tokenizer import tokenizer_from_state
from transformer.training.components.checkpoint import load_checkpoint, model_weights

# model args a fine-tuning run may change: rates, not weights
FREE_AT_INIT = ("dropout", "attention_dropout", "ffn_dropout")


@dataclass
class InitFrom:
    path: str
    weights: dict  # what Trainer.load_weights takes: {"model_args": ..., "model": state dict}
    tokenizer_state: dict  # tokenizer_from_state() rebuilds the tokenizer the weights were trained with
    config: dict = field(default_factory=dict)  # the config it was trained with ({} if unknown)
    which: str = "its weights"  # which of the checkpoint's weights, for the log


def read_init_from(path: str) -> InitFrom:
    """The weights validation scored: the weight average of a run with trainer.ema_decay (by which its best.pt
    was chosen), else the trained weights. Nothing else of the checkpoint is kept (its optimiser state alone is
    twice the model)."""
    ckpt = load_checkpoint(path)
    config = ckpt.get("config") or {}
    if "tokenizer" not in config:  # a Hugging Face folder: its tokenizer's settings, as far as its state says them
        config = {**config, "tokenizer": tokenizer_settings(ckpt["tokenizer"])}
    which = ("its weight average (trainer.ema_decay), which its validation scored" if "ema" in ckpt
             else "its trained weights")
    weights = {"model_args": ckpt.get("model_args"), "model": model_weights(ckpt)}
    return InitFrom(path, weights, ckpt["tokenizer"], config, which)


def tokenizer_settings(state: dict) -> dict:
    """The `tokenizer.*` settings a tokenizer state shows without the config that made it: a shared BPE
    vocabulary's type, size and target subset (an imported Hugging Face folder carries no config)."""
    if state.get("name") != "bpe":
        return {}
    size = tokenizer_from_state(state).src_vocab_size  # the shared vocabulary: every type, specials included
    return {"name": "bpe", "vocab_size": size, "tgt_vocab": "seen" if "n_tgt" in state else "full"}


def prepare_init_from(cfg) -> Optional[InitFrom]:
    """trainer.init_from's weights and tokenizer, once its tokenizer settings are checked against the config's;
    None without init_from."""
    if not cfg.trainer.init_from:
        return None
    init = read_init_from(cfg.trainer.init_from)
    state, where = init.tokenizer_state, f"trainer.init_from={init.path}"
    asked = []
    saved, mine = init.config.get("tokenizer") or {}, to_container(cfg).get("tokenizer") or {}
    if state.get("name") != "copy":
        asked = [f"tokenizer.{k}={mine[k]!r} (the checkpoint's: {saved[k]!r})"
                 for k in sorted(saved.keys() & mine.keys()) if saved[k] != mine[k]]
        for side in ("src_lang", "tgt_lang"):
            if state.get(side) and state[side] != cfg.data[side]:
                asked.append(f"data.{side}={cfg.data[side]!r} (the checkpoint's: {state[side]!r})")
    if asked:
        raise ConfigError(f"{where} is fine-tuned with its own tokenizer ({state.get('name')}), whose ids its weights "
                          f"were trained on, but this config asks for another: {'; '.join(asked)}. Drop those "
                          "settings, or train a new model without trainer.init_from")
    check_model(cfg, init)
    return init


def override_value(v) -> str:
    """A value as a command-line override spells it."""
    return str(v).lower() if isinstance(v, bool) else "null" if v is None else str(v)


def check_model(cfg, init: InitFrom) -> None:
    """The config's `model` group builds the model of the weights (the vocabulary sizes come from their tokenizer),
    before any data is prepared; otherwise one line lists the overrides that do (a released model's
    architecture, say: `model.activation=swish model.output_bias=true ...`)."""
    from dataclasses import fields

    from transformer.config import ModelConfig
    from transformer.model import ModelArgs

    saved = init.weights.get("model_args")
    if not isinstance(saved, dict):
        return
    saved = ModelArgs.from_dict(saved)
    mine = ModelArgs.from_config(cfg.model, saved.src_vocab_size, saved.tgt_vocab_size, saved.shared_vocab)
    keys = [f.name for f in fields(ModelConfig) if f.name not in FREE_AT_INIT]
    wrong = [k for k in keys if getattr(saved, k, None) != getattr(mine, k, None)]
    if wrong:
        fix = " ".join(f"model.{k}={override_value(getattr(saved, k))}" for k in wrong)
        have = ", ".join(f"model.{k}={override_value(getattr(mine, k))}" for k in wrong)
        raise ConfigError(f"trainer.init_from={init.path} holds a model this config does not build: set {fix} "
                          f"(this config has {have})")


def check_tokenizer(init: Optional[InitFrom], tokenizer) -> None:
    """The data's tokenizer is the checkpoint's (a data.preprocessed folder, or the copy task's, makes its own)."""
    if init is not None and tokenizer.state_dict() != init.tokenizer_state:
        raise ConfigError(f"trainer.init_from={init.path}: the data is encoded with another tokenizer than the one "
                          "its weights were trained with (a data.preprocessed folder made with another tokenizer, or "
                          "other data.copy settings): use data of the checkpoint's tokenizer")
