"""Translation: BLEU and chrF (sacreBLEU, default settings) of the validation split's translations."""
from dataclasses import replace
from typing import Dict, List, Optional

from transformer.config import EvalConfig, eval_from_dict, to_container
from transformer.decoding import translate_sentences
from transformer.tasks.base import Metric, Task


def as_eval_config(ev) -> EvalConfig:
    """The run's `eval` section (a DictConfig) as the EvalConfig dataclass, so `replace` can vary it."""
    return ev if isinstance(ev, EvalConfig) else eval_from_dict(to_container(ev))


def decode(model, tokenizer, sentences: List[str], ev, device) -> list:
    """The sentences' n-best lists by eval.backend: the torch decoder, or CTranslate2 on the CPU over the weights
    exported now (a rank's own temporary folder)."""
    if getattr(ev, "backend", "torch") == "torch":
        return translate_sentences(model, tokenizer, sentences, ev, device)
    import torch

    from transformer.data.tokenizer import encode_sources
    from transformer.interop.backend import exported_decoder

    with exported_decoder(model, tokenizer, torch.get_num_threads()) as ct2_decode:
        return ct2_decode(model, tokenizer, encode_sources(tokenizer, sentences), ev)


def valid_bleu(model, data, env, ev) -> Dict[str, float]:
    """Corpus BLEU and chrF of the model's translations of the validation sources `data.valid_srcs` (the
    first `ev.bleu_sentences` if set) against `data.valid_refs`.

    Sentence i is translated by rank i % world_size with `ev.beam`; rank 0 restores the input order,
    scores, and broadcasts, so every rank returns the same {"val_bleu", "val_chrf"}. Collective: every
    rank must call it.
    """
    import sacrebleu

    srcs, refs = list(data.valid_srcs), list(data.valid_refs)
    n = len(srcs) if ev.bleu_sentences is None else min(len(srcs), int(ev.bleu_sentences))
    mine = list(range(env.rank, n, env.world_size))
    hyps = decode(model, data.tokenizer, [srcs[i] for i in mine], ev, env.device)
    gathered = env.gather_objects([(i, h[0].text) for i, h in zip(mine, hyps, strict=False)])
    result = None
    if env.is_main:
        texts = [""] * n
        for part in gathered:
            for i, text in part:
                texts[i] = text
        result = {"val_bleu": sacrebleu.corpus_bleu(texts, [refs[:n]]).score,
                  "val_chrf": sacrebleu.corpus_chrf(texts, [refs[:n]]).score}
    return env.broadcast_object(result)


def tune_lenpen(model, data, env, ev, grid: List[float]) -> Dict[str, float]:
    """Validation BLEU at each length penalty of `grid`, as the paper chose its beam and length penalty "after
    experimentation on the development set" (section 6.1); {"lenpen": the best, "val_bleu_lenpen<x>": BLEU
    at x, ...}. A tie keeps the earlier value of `grid`. Collective."""
    base = as_eval_config(ev)
    scores = {}
    for lenpen in grid:
        scores[float(lenpen)] = valid_bleu(model, data, env, replace(base, lenpen=float(lenpen)))["val_bleu"]
    best = max(scores, key=scores.get)  # max keeps the first of equal scores
    return {"lenpen": best, **{f"val_bleu_lenpen{x:g}": s for x, s in scores.items()}}


class TranslationTask(Task):
    name = "translation"

    def scores(self) -> List[Metric]:
        if not self.cfg.eval.bleu:
            return []
        return [Metric("val_bleu", higher_is_better=True, levels=(30.0, 35.0, 38.0, 40.0)),
                Metric("val_chrf", higher_is_better=True)]

    def validate(self, model, data, env) -> Dict[str, float]:
        if not self.cfg.eval.bleu:
            return {}
        ev = as_eval_config(self.cfg.eval)
        if ev.valid_beam is not None:
            ev = replace(ev, beam=ev.valid_beam, nbest=1)
        return valid_bleu(model, data, env, ev)

    def tune(self, model, data, env) -> Optional[Dict[str, float]]:
        grid = list(self.cfg.eval.tune_lenpen)  # config_checks.check_eval: a grid needs eval.bleu
        return tune_lenpen(model, data, env, self.cfg.eval, grid) if grid else None

    def sample_sentence(self, data) -> Optional[str]:
        return data.valid_srcs[0] if data.valid_srcs else None
