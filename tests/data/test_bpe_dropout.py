"""BPE-dropout (data.bpe_dropout): plain segmentation equals `tokenizers`' own, epochs are functions of
(seed, epoch) that decode to the training text, long sentences fall back to the plain segmentation, and the
DataModule plans every epoch from that epoch's lengths."""
import random

import numpy as np
import pytest
import torch

from tests.helpers.data import MULTI30K, TRAIN_DE, TRAIN_EN, VAL_DE, data_cfg, needs_multi30k, small_files_cfg
from transformer.data.batch import PairDataset, Ragged
from transformer.data.bpe_dropout import BpeDropout, merge_ranks, segment
from transformer.data.tokenizer import BpeTokenizer
from transformer.data.translation import build_translation_data
from transformer.dist import DistEnv
from transformer.specials import PAD, UNK


@pytest.fixture(scope="module")
def tok():
    return BpeTokenizer.train(TRAIN_DE + TRAIN_EN, vocab_size=150, min_freq=1, src_lang="de", tgt_lang="en")


def stored(tok, src=TRAIN_DE, tgt=TRAIN_EN) -> PairDataset:
    return PairDataset(Ragged.from_lists(tok.encode_src_batch(src)), Ragged.from_lists(tok.encode_tgt_batch(tgt)))


def sides(data: PairDataset):
    return [data.src[i].tolist() for i in range(len(data))], [data.tgt[i].tolist() for i in range(len(data))]


def test_plain_segmentation_is_the_tokenizers_own(tok):
    ranks, rng = merge_ranks(tok.tok), random.Random(0)
    for text in TRAIN_DE + TRAIN_EN:
        for word, _ in tok.tok.pre_tokenizer.pre_tokenize_str(text):
            assert segment(word, ranks, 0.0, rng) == [t.value for t in tok.tok.model.tokenize(word)], word
    plain = stored(tok)
    for epoch in (0, 5):
        assert sides(BpeDropout(tok, plain, 0.0, 4, seed=1, max_len=256).epoch(epoch)) == sides(plain)


def test_epochs_are_seeded_and_decode_to_the_training_text(tok):
    plain = stored(tok)
    bd = BpeDropout(tok, plain, 0.3, 8, seed=7, max_len=256)
    one, again = bd.epoch(1), BpeDropout(tok, plain, 0.3, 8, seed=7, max_len=256).epoch(1)
    assert sides(one) == sides(again) == sides(bd.epoch(1))  # a resumed run, or another rank, sees the same
    assert sides(one) != sides(bd.epoch(2))
    assert sides(one) != sides(BpeDropout(tok, plain, 0.3, 8, seed=8, max_len=256).epoch(1))
    assert one.tgt.data.size > plain.tgt.data.size  # dropped merges leave more, shorter pieces
    src, tgt = sides(one)
    assert [tok.decode_tgt(s) for s in src] == TRAIN_DE and [tok.decode_tgt(t) for t in tgt] == TRAIN_EN
    np.testing.assert_array_equal(one.src_sizes, np.array([len(s) + 1 for s in src]))


def test_a_sentence_longer_than_max_len_keeps_its_plain_segmentation(tok):
    plain = stored(tok)
    limit = int(max(plain.src.lengths.max(), plain.tgt.lengths.max()))
    epoch = BpeDropout(tok, plain, 0.6, 8, seed=1, max_len=limit).epoch(0)
    assert max(epoch.src.lengths.max(), epoch.tgt.lengths.max()) <= limit
    src, plain_src = sides(epoch)[0], sides(plain)[0]
    longest = int(np.argmax(plain.src.lengths))
    assert src[longest] == plain_src[longest]  # any dropped merge would have made it longer than the limit


def test_a_sentence_with_unknown_characters_keeps_its_stored_ids(tok):
    data = stored(tok, ["Ein Mann fährt ☃ Fahrrad."], ["A man rides a ☃ bike."])
    assert UNK in data.src[0].tolist()  # decoding drops <unk>: re-segmenting the text cannot give these ids
    for epoch in range(3):
        assert sides(BpeDropout(tok, data, 0.5, 4, seed=1, max_len=256).epoch(epoch)) == sides(data)


def test_data_module_plans_each_epoch_from_its_own_lengths(tmp_path):
    cfg = small_files_cfg(tmp_path, tokenizer="bpe", max_tokens=40, bpe_dropout=0.3)
    data = build_translation_data(cfg, DistEnv())
    plain = [b.n_tokens for b in data._loader(data.train, data.train_sampler.rank_batches(0))]
    for epoch in range(3):
        batches = list(data.train_loader(epoch))
        assert len(batches) == data.num_train_batches(epoch)
        assert sorted(i for b in batches for i in b.ids.tolist()) == list(range(len(TRAIN_EN)))
        assert all(b.src.numel() <= 40 and b.tgt_in.numel() <= 40 for b in batches)
        assert sum(b.n_tokens for b in batches) > sum(plain)
    resumed = [b.tgt_out.tolist() for b in data.train_loader(2, start=1)]  # mid-epoch, as after a resume
    assert resumed == [b.tgt_out.tolist() for b in data.train_loader(2)][1:]


def test_epochs_before_bpe_dropout_from_epoch_are_plain(tmp_path):
    cfg = small_files_cfg(tmp_path, tokenizer="bpe", max_tokens=40, bpe_dropout=0.3, bpe_dropout_from_epoch=2)
    data = build_translation_data(cfg, DistEnv())

    def tokens(epoch):
        return sum(b.n_tokens for b in data.train_loader(epoch))
    plain = int(data.train.tgt.lengths.sum()) + len(data.train)  # + </s> each
    assert tokens(0) == tokens(1) == plain < tokens(2)
    assert data._train(1)[1] is data.train_sampler  # a plain epoch reuses the stored split's batch plan


@needs_multi30k
@pytest.mark.slow
def test_multi30k_plain_segmentation_reproduces_the_cache(tmp_path):
    """Every one of Multi30k's 29,000 training pairs re-segments to its stored ids (no sentence kept as
    stored), and a p=0.1 epoch decodes to the same text."""
    cfg = data_cfg(tmp_path, "multi30k", "bpe", cache_dir=str(tmp_path / "cache"), max_tokens=2048,
                   tok={"vocab_size": 8000})
    cfg.data.root = str(MULTI30K)  # the raw files, only read
    data = build_translation_data(cfg, DistEnv())
    assert sides(BpeDropout(data.tokenizer, data.train, 0.0, 1, seed=1, max_len=256).epoch(0)) == sides(data.train)
    epoch = BpeDropout(data.tokenizer, data.train, 0.1, 8, seed=1, max_len=256).epoch(0)
    texts = data.tokenizer.tok.decode_batch([data.train.tgt[i].tolist() for i in range(len(data.train))])
    assert data.tokenizer.tok.decode_batch([epoch.tgt[i].tolist() for i in range(len(epoch))]) == texts


def test_a_seen_target_vocabulary_trains_and_translates(tmp_path):
    """tokenizer.tgt_vocab=seen end to end: the data's target side stays below its size, the tied model scores
    that many types, a few steps lower the loss, and beam search decodes from the smaller output layer."""
    from transformer.config import EvalConfig, ModelConfig
    from transformer.decoding.translate import translate_sentences
    from transformer.model import Transformer
    from transformer.training.components.loss import label_smoothed_cross_entropy
    cfg = small_files_cfg(tmp_path, tokenizer="bpe", max_tokens=200, tok={"min_freq": 1, "vocab_size": 120,
                                                                          "tgt_vocab": "seen"})
    data = build_translation_data(cfg, DistEnv())
    assert data.tgt_vocab_size < data.src_vocab_size == 120
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=1, d_model=32, d_ff=64, h=4, dropout=0.0, tie_embeddings="all"),
                                    data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        for b in data.train_loader(0):
            assert int(b.tgt_out.max()) < data.tgt_vocab_size
            logits = model(b.src, b.tgt_in)  # (B, T, tgt_vocab_size)
            loss = label_smoothed_cross_entropy(logits, b.tgt_out, 0.1, PAD)[0] / b.n_tokens
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    out = translate_sentences(model, data.tokenizer, VAL_DE, EvalConfig(beam=3))
    assert len(out) == len(VAL_DE) and all(isinstance(n[0].text, str) for n in out)
    assert all(i < data.tgt_vocab_size for n in out for i in n[0].tokens)
