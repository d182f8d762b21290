"""The copy task (Annotated Transformer, "A First Example"): exact-match accuracy of greedy decoding."""
from typing import Dict, List, Optional

import torch

from transformer.data.batch import PairDataset, collate
from transformer.decoding import greedy_decode
from transformer.tasks.base import Metric, Task

# A copy has exactly the source's length: a + b = 2 leaves room for the </s> (and one token of slack).
MAX_LEN_A, MAX_LEN_B = 1.0, 2


@torch.no_grad()
def copy_accuracy(model, dataset: PairDataset, env, batch_size: int = 250) -> float:
    """Share of sequences that greedy decoding reproduces exactly; the sequences are split over ranks
    and the counts summed, so every rank returns the same number."""
    idx = list(range(env.rank, len(dataset), env.world_size))
    correct = 0
    for i in range(0, len(idx), batch_size):
        items = [dataset[j] for j in idx[i:i + batch_size]]
        hyps = greedy_decode(model, collate(items).src.to(env.device), MAX_LEN_A, MAX_LEN_B)
        correct += sum(int(hyp == tgt.tolist()) for (_, _, tgt), hyp in zip(items, hyps, strict=False))
    correct, total = env.all_reduce_sum([correct, len(idx)])
    return correct / max(total, 1)


class CopyTask(Task):
    name = "copy"

    def scores(self) -> List[Metric]:
        return [Metric("val_accuracy", higher_is_better=True, levels=(0.9, 0.99, 1.0))]

    def validate(self, model, data, env) -> Dict[str, float]:
        return {"val_accuracy": copy_accuracy(model, data.valid, env)}

    def test(self, model, data, env) -> Dict[str, float]:
        """Exact-match accuracy on fresh sequences (the test split)."""
        return {"test_accuracy": copy_accuracy(model, data.test, env)}

    def sample_sentence(self, data) -> Optional[str]:
        return data.tokenizer.decode_src(data.valid[0][1]) if len(data.valid) else None
