"""Validation scores that need decoding: exact-match accuracy on the copy task, BLEU on translation data."""
import torch

from transformer.data.batch import PairDataset, collate
from transformer.decode import greedy_decode, option, translate_sentences


@torch.no_grad()
def copy_accuracy(model, dataset: PairDataset, env, device: torch.device, batch_size: int = 250) -> float:
    """Share of sequences that greedy decoding reproduces exactly; the sequences are split over ranks
    and the counts summed, so every rank returns the same number."""
    idx = list(range(env.rank, len(dataset), env.world_size))
    correct = 0
    for i in range(0, len(idx), batch_size):
        batch = collate([dataset[j] for j in idx[i:i + batch_size]])
        src = batch.src.to(device)
        hyps = greedy_decode(model, src, max_len_a=1.0, max_len_b=2)
        for (_, _, tgt), hyp in zip((dataset[j] for j in idx[i:i + batch_size]), hyps, strict=True):
            correct += int(hyp == tgt.tolist())
    correct, total = env.all_reduce_sum([correct, len(idx)])
    return correct / max(total, 1)


def valid_bleu(model, data, env, eval_cfg, device: torch.device) -> dict:
    """Corpus BLEU and chrF (sacreBLEU, default settings) of the model's translations of the validation
    sources `data.valid_srcs` (the first `eval.bleu_sentences` if set) against `data.valid_refs`.

    Sentence i is translated by rank i % world_size with `eval.beam`; rank 0 restores the input order,
    scores, and broadcasts, so every rank returns the same {"val_bleu", "val_chrf"}. Collective: every
    rank must call it.
    """
    import sacrebleu

    srcs, refs = list(data.valid_srcs), list(data.valid_refs)
    limit = option(eval_cfg, "bleu_sentences")
    n = len(srcs) if limit is None else min(len(srcs), int(limit))
    mine = list(range(env.rank, n, env.world_size))
    hyps = translate_sentences(model, data.tokenizer, [srcs[i] for i in mine], eval_cfg, device)
    gathered = env.gather_objects([(i, h[0].text) for i, h in zip(mine, hyps, strict=True)])
    result = None
    if env.is_main:
        texts = [""] * n
        for part in gathered:
            for i, text in part:
                texts[i] = text
        result = {"val_bleu": sacrebleu.corpus_bleu(texts, [refs[:n]]).score,
                  "val_chrf": sacrebleu.corpus_chrf(texts, [refs[:n]]).score}
    return env.broadcast_object(result)
