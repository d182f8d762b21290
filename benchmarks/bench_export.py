"""CPU decoding speed of transformer-translate's search against CTranslate2 float32 and int8 on the same
sentences (Multi30k test_2016_flickr), one timed run each: sentences/s.

    python benchmarks/bench_export.py [CHECKPOINT] [--sentences 1000] [--threads 2] [--beam 5]

Without CHECKPOINT the model is randomly initialised at the size of conf/model/small.yaml (N=3, d_model=256,
d_ff=1024, h=8) with the recipe's shared BPE (8,000 types, tokenizer.tgt_vocab=seen) learnt on the training
split. Speed does not depend on the weights except through output lengths, so every output gets exactly
a * source_length + b tokens (a=1, b=0): </s> is banned in our search (stop_at_eos=False) and CTranslate2 gets
min_decoding_length = max_decoding_length. Tokenisation is outside the timings (ids and token strings are
prepared first); both sides batch by source tokens (--batch-tokens) and translate the first 8 sentences untimed
first. Each line also gives the process's CPU seconds (all threads): on a shared machine, wall time also counts
the time other processes held the cores.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_decode import find_multi30k  # noqa: E402 (benchmarks/ is this script's folder)

from transformer.config import EvalConfig, ModelConfig  # noqa: E402
from transformer.data.corpus import read_lines  # noqa: E402
from transformer.decoding.translate import translate_ids  # noqa: E402


def build_model(args, data: Path):
    if args.checkpoint:
        from transformer.training.components.checkpoint import load_model
        model, tokenizer, _ = load_model(args.checkpoint)
        return model, tokenizer, f"checkpoint {args.checkpoint}"
    from transformer.data.config import TokenizerConfig
    from transformer.data.tokenizer import train_tokenizer
    from transformer.model import Transformer

    tok = train_tokenizer(TokenizerConfig(name="bpe", vocab_size=8000, tgt_vocab="seen"), "de", "en",
                          read_lines(data / "train.de.gz"), read_lines(data / "train.en.gz"))
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=3, d_model=256, d_ff=1024, h=8, dropout=0.0), tok.src_vocab_size,
                                    tok.tgt_vocab_size, shared_vocab=True)
    return model.eval(), tok, (f"random init, N=3 d_model=256 d_ff=1024 h=8, BPE {tok.src_vocab_size} "
                               f"(target {tok.tgt_vocab_size})")


def ct2_run(translator, tokens, lims, beam: int, batch_tokens: int) -> None:
    """Translates every source, one call per output length (CTranslate2's limits are per call)."""
    from transformer.interop.ct2 import SUPPRESSED
    for limit in sorted(set(lims)):
        batch = [t for t, n in zip(tokens, lims, strict=True) if n == limit]
        translator.translate_batch(batch, beam_size=beam, max_decoding_length=limit, min_decoding_length=limit,
                                   max_batch_size=batch_tokens, batch_type="tokens", suppress_sequences=SUPPRESSED)


def timed(name: str, n: int, fn) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name:<36} {n / wall:8.1f} sentences/s ({wall:.1f} s wall, {cpu:.1f} s CPU)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--batch-tokens", type=int, default=8000)
    args = p.parse_args(argv)
    import ctranslate2

    from transformer.interop.ct2 import export_ct2, source_tokens

    torch.set_num_threads(args.threads)
    data = find_multi30k()
    model, tok, what = build_model(args, data)
    src = read_lines(data / "test_2016_flickr.de.gz")[:args.sentences]
    ids = tok.encode_src_batch(src)
    tokens = source_tokens(tok, src)
    lims = [len(x) + 1 for x in ids]  # a=1, b=0: source length with its </s>
    ev = EvalConfig(beam=args.beam, max_len_a=1.0, max_len_b=0, batch_tokens=args.batch_tokens)
    print(f"{what} | {len(src)} sentences, beam {args.beam}, {args.threads} thread(s), torch {torch.__version__}, "
          f"ctranslate2 {ctranslate2.__version__}")
    translate_ids(model, tok, ids[:8], ev, "cpu", stop_at_eos=False)
    timed("transformer-translate (torch fp32)", len(src), lambda: translate_ids(model, tok, ids, ev, "cpu",
                                                                                stop_at_eos=False))
    with tempfile.TemporaryDirectory() as tmp:
        for name, quant in (("float32", None), ("int8", "int8")):
            export_ct2(model, tok, Path(tmp) / name, quant)
            translator = ctranslate2.Translator(str(Path(tmp) / name), device="cpu", compute_type=name,
                                               intra_threads=args.threads)
            ct2_run(translator, tokens[:8], lims[:8], args.beam, args.batch_tokens)
            timed(f"CTranslate2 {name}", len(src), lambda t=translator: ct2_run(t, tokens, lims, args.beam,
                                                                               args.batch_tokens))


if __name__ == "__main__":
    main()
