"""Special token ids, the same in every vocabulary: the model and the data pipeline both import them."""
PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
