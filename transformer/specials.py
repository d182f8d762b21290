"""Special token ids, the same in every vocabulary: the model and the data pipeline both import them."""
PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
SPECIAL_IDS = frozenset(range(len(SPECIALS)))  # <unk> too: decoding drops every special


def until_eos(ids, drop) -> list:
    """Ids (ints or 0-dim tensors) up to the first </s>, without those in `drop`: what a tokenizer decodes of a
    decoder's output."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i not in drop:
            out.append(i)
    return out
