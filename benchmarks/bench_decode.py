"""Decoding speed on Multi30k test_2016_flickr: sentences/s and output tokens/s.

    python benchmarks/bench_decode.py [CHECKPOINT] [--sentences 1000] [--threads 1] [--device cpu]

Compares, on the same source sentences:
  * this project's batched search (sentences grouped by length, --batch-tokens source tokens a batch),
    greedy / beam 4 / beam 5, each with the key/value cache and without it (whole prefix re-run each step);
  * the Annotated Transformer's greedy_decode: one sentence at a time, the decoder re-run on the whole
    prefix every step.
Without CHECKPOINT the model is randomly initialised at the size of conf/model/small.yaml (N=3,
d_model=256, d_ff=1024, h=8) with spaCy vocabularies built from the Multi30k training split. Speed does
not depend on the weights except through output lengths, so by default </s> is banned and every
hypothesis gets exactly a * source_length + b tokens (a=1, b=0: about a real translation's length);
`--stop-at-eos` lets a trained checkpoint stop where it wants (then lengths differ between methods and
tokens/s is the fairer figure).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.decoding import Uncached  # noqa: E402 (the uncached decoder lives with the tests)
from transformer.config import EvalConfig, ModelConfig  # noqa: E402
from transformer.data.batch import BOS, EOS  # noqa: E402
from transformer.data.corpus import read_lines  # noqa: E402
from transformer.decoding import encode_batch, length_batches, search  # noqa: E402
from transformer.decoding.search import max_lengths  # noqa: E402
from transformer.model.layers import no_cudnn_attention  # noqa: E402


def find_multi30k() -> Path:
    """$MULTI30K_DIR, else ../shared/data/multi30k beside the repository (as the tests look for it)."""
    root = Path(os.environ.get("MULTI30K_DIR") or REPO.parent / "shared/data/multi30k")
    if not (root / "test_2016_flickr.de.gz").is_file():
        sys.exit(f"bench_decode: no Multi30k test_2016_flickr.de.gz in {root} (set MULTI30K_DIR)")
    return root


def build_model(args, data: Path):
    if args.checkpoint:
        from transformer.training.components.checkpoint import load_model
        model, tokenizer, _ = load_model(args.checkpoint)
        return model, tokenizer, f"checkpoint {args.checkpoint}"
    from transformer.data.tokenizer import SpacyTokenizer
    from transformer.model import Transformer

    t = time.perf_counter()
    tok = SpacyTokenizer.train(read_lines(data / "train.de.gz"), read_lines(data / "train.en.gz"), "de", "en",
                               min_freq=2)
    del tok.train_ids
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=3, d_model=256, d_ff=1024, h=8, dropout=0.0), tok.src_vocab_size,
                                    tok.tgt_vocab_size)
    return model.eval(), tok, (f"random init, N=3 d_model=256 d_ff=1024 h=8, spaCy vocab de {tok.src_vocab_size} / "
                               f"en {tok.tgt_vocab_size} (built in {time.perf_counter() - t:.0f}s)")


def ours(model, ids, cfg: EvalConfig, device, use_cache: bool, stop: bool):
    """Batched search as translate_sentences runs it (without the tokenisation)."""
    tokens = 0
    decoder = model if use_cache else Uncached(model)
    for batch in length_batches([len(x) + 1 for x in ids], cfg.batch_tokens):
        src = encode_batch([ids[i] for i in batch], device)
        for nbest in search(decoder, src, cfg, stop_at_eos=stop):
            tokens += len(nbest[0].tokens) + 1  # + </s>
    return tokens


@torch.no_grad()
def annotated_greedy(model, ids, cfg: EvalConfig, device, stop: bool):
    """The Annotated Transformer's greedy_decode, one sentence at a time: the whole prefix is re-run
    through the decoder for every new token."""
    tokens = 0
    for x in ids:
        src = encode_batch([x], device)  # (1, S)
        limit = int(max_lengths(src, cfg.max_len_a, cfg.max_len_b)[0])
        memory, src_mask = model.encode(src)
        ys = torch.full((1, 1), BOS, dtype=torch.long, device=device)
        for _ in range(limit):
            out = model.tgt_embed(ys)  # (1, T, D)
            # cross-attention keys/values recomputed every step, as in AT
            for layer, kv in zip(model.decoder, model.project_memory(memory), strict=True):
                out = layer(out, kv, src_mask)
            logits = model.generator(model.dec_norm(out[:, -1]))  # (1, V): AT projects the last position only
            if not stop:
                logits[:, EOS] = -float("inf")
            nxt = logits.argmax(dim=-1, keepdim=True)
            ys = torch.cat([ys, nxt], dim=1)
            if stop and int(nxt) == EOS:
                break
        tokens += ys.size(1) - 1 + (0 if stop and int(ys[0, -1]) == EOS else 1)
    return tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--sentences", type=int, default=1000, help="first N sentences of test_2016_flickr")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-tokens", type=int, default=8000)
    p.add_argument("--stop-at-eos", action="store_true", help="let hypotheses end at </s> (trained checkpoints)")
    p.add_argument("--skip-slow", action="store_true", help="skip uncached beam search and the Annotated baseline")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    no_cudnn_attention(device)  # as translate_ids does for every other decoding
    data = find_multi30k()
    model, tokenizer, what = build_model(args, data)
    model.to(device)
    srcs = read_lines(data / "test_2016_flickr.de.gz")[:args.sentences]
    from transformer.data.tokenizer import encode_sources
    ids = encode_sources(tokenizer, srcs)
    stop = args.stop_at_eos
    a, b = (1.2, 10) if stop else (1.0, 0)
    print(f"model: {what}")
    print(f"data: test_2016_flickr, {len(ids)} sentences, {sum(map(len, ids))} source tokens; device {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch_tokens {args.batch_tokens}")
    fixed = "fixed: </s> banned, exactly 1.0 * source length tokens (the source's </s> counted)"
    print(f"output length: {'until </s>, at most 1.2 * source length + 10' if stop else fixed}")
    print(f"{'method':<52} {'seconds':>8} {'sent/s':>8} {'tok/s':>9}")
    runs = []
    for beam in (1, 4, 5):
        for cache in (True, False):
            if args.skip_slow and not cache and beam > 1:
                continue
            name = f"ours {'greedy' if beam == 1 else f'beam {beam}'}, {'cached' if cache else 'uncached'}, batched"
            runs.append((name, lambda beam=beam, cache=cache: ours(
                model, ids, EvalConfig(beam=beam, max_len_a=a, max_len_b=b, batch_tokens=args.batch_tokens),
                device, cache, stop)))
    if not args.skip_slow:
        runs.append(("Annotated Transformer greedy, 1 sentence at a time",
                     lambda: annotated_greedy(model, ids, EvalConfig(max_len_a=a, max_len_b=b), device, stop)))
    ours(model, ids[:16], EvalConfig(beam=2, max_len_a=a, max_len_b=b), device, True, stop)  # warm-up
    results = {}
    for name, fn in runs:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - start
        results[name] = sec
        print(f"{name:<52} {sec:8.2f} {len(ids) / sec:8.1f} {tokens / sec:9.0f}", flush=True)
    base = results.get("Annotated Transformer greedy, 1 sentence at a time")
    if base:
        for name in ("ours greedy, cached, batched", "ours beam 5, cached, batched"):
            print(f"speed-up of '{name}' over the Annotated Transformer greedy: {base / results[name]:.1f}x")
    for beam in ("greedy", "beam 4", "beam 5"):
        c, u = results.get(f"ours {beam}, cached, batched"), results.get(f"ours {beam}, uncached, batched")
        if c and u:
            print(f"key/value cache speed-up, {beam}: {u / c:.2f}x")


if __name__ == "__main__":
    main()
