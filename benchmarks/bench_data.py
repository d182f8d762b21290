"""Data pipeline benchmark on Multi30k (de->en): prints measured numbers, asserts nothing.

    python benchmarks/bench_data.py [--multi30k DIR] [--steps 20] [--threads 2]

1. preprocessing: tokenisation + vocabulary + cache build for train/val, first run and cached run
   (in this process and in a fresh one), for tokenizer=spacy and tokenizer=bpe;
2. detokeniser round trip on val: exact-match rate and sacreBLEU of decode(encode(ref)) against ref;
3. sampler: padding share at the default data.max_tokens, against the previous (target, source) sort,
   epoch planning time, and loader throughput (batches/s, sampler + collate, num_workers=0);
4. a CPU training step of model=tiny (N=2, d_model=128, d_ff=256, h=4): real target tokens/s fed by our
   token-bucketed batches vs Annotated-Transformer-style batches (32 random sentences padded to 72).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from transformer.data.batch import BOS, EOS, PAD, UNK, Batch  # noqa: E402
from transformer.data.config import DataConfig, TokenizerConfig  # noqa: E402
from transformer.dist import DistEnv  # noqa: E402


def make_cfg(root: Path, cache: Path, tokenizer: str):
    data = DataConfig(name="multi30k", root=str(root), cache_dir=str(cache))
    return OmegaConf.create({"data": OmegaConf.structured(data),
                             "tokenizer": OmegaConf.structured(TokenizerConfig(name=tokenizer)), "seed": 1})


def offline_root(multi30k: Path, tmp: Path) -> Path:
    folder = tmp / "root" / "multi30k"
    folder.mkdir(parents=True)
    for f in multi30k.glob("*.gz"):
        (folder / f.name).symlink_to(f.resolve())  # a relative target would resolve from `folder`
    return tmp / "root"


def bench_preprocessing(root: Path, tmp: Path):
    from transformer.data.translation import build_translation_data
    out = {}
    for tok in ("spacy", "bpe"):
        cache = tmp / f"cache-{tok}"
        cfg = make_cfg(root, cache, tok)
        t0 = time.perf_counter()
        dm = build_translation_data(cfg, DistEnv(), None)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_translation_data(cfg, DistEnv(), None)
        cached = time.perf_counter() - t0
        code = ("import sys,time; t=time.perf_counter(); sys.path.insert(0, sys.argv[1]);"
                "from omegaconf import OmegaConf; from transformer.dist import DistEnv;"
                "from transformer.data.translation import build_translation_data;"
                "cfg=OmegaConf.create(OmegaConf.load(sys.argv[2]));"
                "dm=build_translation_data(cfg, DistEnv(), None); print(time.perf_counter()-t)")
        cfg_file = tmp / f"cfg-{tok}.yaml"
        OmegaConf.save(cfg, cfg_file)
        fresh = float(subprocess.run([sys.executable, "-c", code, str(REPO), str(cfg_file)], check=True,
                                     capture_output=True, text=True).stdout.split()[-1])
        print(f"preprocess tokenizer={tok:5s}: first run {first:6.2f} s | cached, same process {cached:5.2f} s | "
              f"cached, fresh process (imports included) {fresh:5.2f} s | "
              f"vocab {dm.src_vocab_size}/{dm.tgt_vocab_size}")
        out[tok] = dm
    return out


def bench_round_trip(dms):
    import sacrebleu
    for tok, dm in dms.items():
        t = dm.tokenizer
        for side, ids, refs, dec in (("src", dm.valid.src, dm.valid_srcs, t.decode_src),
                                     ("tgt", dm.valid.tgt, dm.valid_refs, t.decode_tgt)):
            hyps = [dec(ids[i]) for i in range(len(refs))]
            exact = np.mean([h == r for h, r in zip(hyps, refs, strict=False)])
            no_unk = [h == r for i, (h, r) in enumerate(zip(hyps, refs, strict=False)) if UNK not in ids[i]]
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            print(f"round trip val tokenizer={tok:5s} {side}: exact {100 * exact:5.1f}% of {len(refs)} | "
                  f"exact {100 * np.mean(no_unk):5.1f}% of the {len(no_unk)} sentences without <unk> | "
                  f"sacreBLEU(decode(encode(ref)), ref) = {bleu:.2f}")


def padding(batches, src, tgt):
    real_s = sum(src[b].sum() for b in batches)
    real_t = sum(tgt[b].sum() for b in batches)
    pad_s = sum(len(b) * src[b].max() for b in batches)
    pad_t = sum(len(b) * tgt[b].max() for b in batches)
    return 1 - (real_s + real_t) / (pad_s + pad_t), 1 - real_s / pad_s, 1 - real_t / pad_t


def old_sort_batches(src, tgt, max_tokens, seed):
    """The sampler's first version: sort by (target, source) length, then the same greedy packing."""
    rng = np.random.default_rng([seed, 0])
    order = rng.permutation(len(src))
    order = order[np.lexsort((src[order], tgt[order]))]
    size = np.maximum(src, tgt)[order]
    batches, start, longest = [], 0, 0
    for i in range(len(order)):
        longest_i = max(longest, int(size[i]))
        if (i - start + 1) * longest_i > max_tokens:
            batches.append(order[start:i])
            start, longest_i = i, int(size[i])
        longest = longest_i
    batches.append(order[start:])
    return batches


def bench_sampler(dm):
    from transformer.data.sampler import TokenBatchSampler
    src, tgt = dm.train.src_sizes, dm.train.tgt_sizes
    max_tokens = dm.train_sampler.max_tokens
    for world_size in (1, 2, 4):
        s = TokenBatchSampler(src, tgt, max_tokens, seed=1, world_size=world_size)
        t0 = time.perf_counter()
        batches = s.epoch_batches(0)
        plan = time.perf_counter() - t0
        total, ps, pt = padding(batches, src, tgt)
        print(f"sampler max_tokens={max_tokens} world_size={world_size}: {len(batches)} batches, padding "
              f"{100 * total:.2f}% (source {100 * ps:.2f}%, target {100 * pt:.2f}%), "
              f"epoch planned in {1e3 * plan:.1f} ms")
    old = old_sort_batches(src, tgt, max_tokens, 1)
    total, ps, pt = padding(old, src, tgt)
    print(f"sampler, previous (target, source) sort: {len(old)} batches, padding {100 * total:.2f}% "
          f"(source {100 * ps:.2f}%, target {100 * pt:.2f}%)")
    t0 = time.perf_counter()
    n = sum(1 for _ in dm.train_loader(3))
    dt = time.perf_counter() - t0
    print(f"train loader (sampler + collate, num_workers=0): {n} batches in {dt:.2f} s = {n / dt:.0f} batches/s")


def annotated_batches(dm, batch_size=32, max_padding=72, seed=0):
    """Batches as the Annotated Transformer makes them: shuffled, <s> x </s> and <s> y </s> padded to 72."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(dm.train))
    for k in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[k:k + batch_size]
        src = torch.full((batch_size, max_padding), PAD, dtype=torch.long)
        tgt = torch.full((batch_size, max_padding), PAD, dtype=torch.long)
        for b, i in enumerate(idx):
            s = [BOS] + dm.train.src[i].tolist()[:max_padding - 2] + [EOS]
            t = [BOS] + dm.train.tgt[i].tolist()[:max_padding - 2] + [EOS]
            src[b, :len(s)], tgt[b, :len(t)] = torch.tensor(s), torch.tensor(t)
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        yield Batch(src, tgt_in, tgt_out, torch.as_tensor(idx), int((tgt_out != PAD).sum()))


def our_batches(dm):
    while True:
        for epoch in range(1000):
            yield from dm.train_loader(epoch)


def interleaved(sides: dict, steps: int, warmup: int = 2) -> dict:
    """sides: name -> (step function taking a Batch, endless batch feed). Steps alternate between the sides,
    so a change in machine load during the run hits all alike; only the step functions are timed, after
    `warmup` untimed steps each (allocators, kernels). Returns name -> time, tokens, sents, slots."""
    runs = {name: {"time": 0.0, "tokens": 0, "sents": 0, "slots": 0} for name in sides}
    for k in range(steps + warmup):
        for name, (step, feed) in sides.items():
            batch = next(feed)
            t0 = time.perf_counter()
            step(batch)
            dt = time.perf_counter() - t0
            if k >= warmup:
                r = runs[name]
                r["time"] += dt
                r["tokens"] += batch.n_tokens
                r["sents"] += len(batch)
                r["slots"] += batch.tgt_out.numel()
    return runs


def report(runs: dict, steps: int, label: str) -> float:
    """Prints each side's speed and returns the first side's real target tokens/s over the second's."""
    for name, r in runs.items():
        print(f"{label}, {name:24s}: {r['tokens'] / r['time']:8.0f} real target tokens/s, "
              f"{r['sents'] / r['time']:6.1f} sentences/s, {steps / r['time']:5.2f} steps/s, target padding "
              f"{100 * (1 - r['tokens'] / r['slots']):.1f}% ({steps} steps, {torch.get_num_threads()} threads)")
    a, b = (r["tokens"] / r["time"] for r in runs.values())
    return a / b


def bench_training(dm, steps: int):
    """Both feeds train their own copy of the same model with the same plain step."""
    from transformer.config import ModelConfig
    from transformer.model import Transformer
    from transformer.training.components.loss import label_smoothed_cross_entropy
    cfg = ModelConfig(N=2, d_model=128, d_ff=256, h=4, dropout=0.1)

    def plain_step():
        torch.manual_seed(0)
        model = Transformer.from_config(cfg, dm.src_vocab_size, dm.tgt_vocab_size, dm.shared_vocab).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(batch):
            logits = model(batch.src, batch.tgt_in)
            loss, _ = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.1, PAD)
            (loss / batch.n_tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    runs = interleaved({"ours (max_tokens=4096)": (plain_step(), our_batches(dm)),
                        "annotated (32 x 72)": (plain_step(), annotated_batches(dm))}, steps)
    print(f"speed-up of our batches: {report(runs, steps, 'train step CPU model=tiny'):.2f}x real target tokens/s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--multi30k",
                   default=os.environ.get("MULTI30K_DIR") or str(REPO.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--only-train", action="store_true", help="skip to the training-step comparison (spaCy data)")
    args = p.parse_args()
    if not (Path(args.multi30k) / "train.de.gz").exists():
        sys.exit(f"no Multi30k files in {args.multi30k} (--multi30k DIR)")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = offline_root(Path(args.multi30k), tmp)
        if args.only_train:
            from transformer.data.translation import build_translation_data
            bench_training(build_translation_data(make_cfg(root, tmp / "cache", "spacy"), DistEnv(), None), args.steps)
            return
        dms = bench_preprocessing(root, tmp)
        bench_round_trip(dms)
        bench_sampler(dms["spacy"])
        bench_training(dms["spacy"], args.steps)


if __name__ == "__main__":
    main()
