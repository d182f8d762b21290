"""transformer-evaluate (scores equal sacreBLEU's own API on the written files) and valid_bleu (the
trainer's validation BLEU, also sharded over two gloo processes)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
import torch.multiprocessing as mp

from tests.helpers.cli import free_port
from tests.helpers.data import MULTI30K, needs_multi30k
from tests.helpers.dist import join_gloo
from tests.helpers.models import VOCAB, copy_checkpoint, copy_model, one_thread, random_copy_items  # noqa: F401
from tests.helpers.textfiles import fifo
from transformer import dist
from transformer.cli.evaluate import main
from transformer.config import EvalConfig
from transformer.data.copy import CopyTokenizer
from transformer.dist import DistEnv
from transformer.tasks.translation import valid_bleu
from transformer.training.components.checkpoint import atomic_save


def write_pair(folder: Path, n: int, seed: int):
    """PREFIX.de / PREFIX.en: copy-task sources and, as references, the sources with every 4th sentence
    changed (so BLEU is well below 100)."""
    srcs = [" ".join(str(t) for t in s) for _, s, _ in random_copy_items(n, seed=seed, min_len=4)]
    refs = [s if i % 4 else s + " 5 5" for i, s in enumerate(srcs)]
    (folder / "pairs.de").write_text("\n".join(srcs) + "\n", encoding="utf-8")
    (folder / "pairs.en").write_text("\n".join(refs) + "\n", encoding="utf-8")
    return folder / "pairs"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    prefix = write_pair(folder, 40, seed=11)
    ckpt = folder / "checkpoints" / "model.pt"
    atomic_save(copy_checkpoint(name="files", files={"mytest": str(prefix)}), ckpt)
    return folder, prefix, ckpt


def test_src_ref_scores_equal_sacrebleu_on_the_written_files(setup, capsys):
    folder, prefix, ckpt = setup
    out = folder / "out_a"
    assert main([str(ckpt), "--src", f"{prefix}.de", "--ref", f"{prefix}.en", "--beam", "2",
                 "--out-dir", str(out)]) == 0
    hyps = (out / "pairs.de.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    refs = Path(f"{prefix}.en").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == len(refs) == 40
    result = json.loads((out / "pairs.de.json").read_text())
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert 0 < result["bleu"] < 100
    assert result["bleu_signature"].startswith("nrefs:1|")
    printed = capsys.readouterr().out
    assert result["bleu_signature"] in printed and "BLEU = " in printed and "chrF2 = " in printed


def test_split_from_the_checkpoint_data_config(setup):
    folder, prefix, ckpt = setup
    assert main([str(ckpt), "--split", "mytest", "--beam", "2"]) == 0  # default out dir: next to checkpoints/
    assert main([str(ckpt), "--src", f"{prefix}.de", "--ref", f"{prefix}.en", "--beam", "2",
                 "--out-dir", str(folder / "out_b")]) == 0
    by_split = json.loads((folder / "eval" / "mytest.json").read_text())
    by_files = json.loads((folder / "out_b" / "pairs.de.json").read_text())
    hyps = (folder / "eval" / "mytest.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    refs = Path(f"{prefix}.en").read_text(encoding="utf-8").split("\n")[:-1]
    assert by_split["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert by_split["bleu"] == by_files["bleu"] and by_split["split"] == "mytest"


def test_sources_and_references_from_named_pipes(setup, tmp_path):
    """--src/--ref and a data.files test split read from pipes (each is read once) score as the files do."""
    folder, prefix, ckpt = setup
    assert main([str(ckpt), "--src", f"{prefix}.de", "--ref", f"{prefix}.en", "--beam", "2",
                 "--out-dir", str(tmp_path / "files")]) == 0
    with fifo(tmp_path / "src", Path(f"{prefix}.de").read_bytes()) as src, \
            fifo(tmp_path / "ref", Path(f"{prefix}.en").read_bytes()) as ref:
        assert main([str(ckpt), "--src", str(src), "--ref", str(ref), "--beam", "2",
                     "--out-dir", str(tmp_path / "pipes")]) == 0
    (tmp_path / "split").mkdir()
    atomic_save(copy_checkpoint(name="files", files={"piped": str(tmp_path / "split" / "p")}), tmp_path / "m.pt")
    with fifo(tmp_path / "split" / "p.de", Path(f"{prefix}.de").read_bytes()), \
            fifo(tmp_path / "split" / "p.en", Path(f"{prefix}.en").read_bytes()):
        assert main([str(tmp_path / "m.pt"), "--split", "piped", "--beam", "2",
                     "--out-dir", str(tmp_path / "split")]) == 0
    want = json.loads((tmp_path / "files" / "pairs.de.json").read_text())
    assert json.loads((tmp_path / "pipes" / "src.json").read_text())["bleu"] == want["bleu"]
    assert json.loads((tmp_path / "split" / "piped.json").read_text())["bleu"] == want["bleu"]


def test_long_sources_are_truncated_as_translate_truncates_them(setup, tmp_path, capsys):
    from transformer.cli import translate

    folder, prefix, ckpt = setup
    assert main([str(ckpt), "--src", f"{prefix}.de", "--ref", f"{prefix}.en", "--beam", "2", "--max-source-tokens",
                 "3", "--out-dir", str(tmp_path)]) == 0
    evaluate_warnings = [ln.split(": ", 2)[2] for ln in capsys.readouterr().err.splitlines()]
    assert translate.main([str(ckpt), "--input", f"{prefix}.de", "--beam", "2", "--max-source-tokens", "3",
                           "--output", str(tmp_path / "translated")]) == 0
    translate_warnings = [ln.split(": ", 2)[2] for ln in capsys.readouterr().err.splitlines()[:-1]]
    assert (tmp_path / "pairs.de.hyp").read_text() == (tmp_path / "translated").read_text()
    assert len(evaluate_warnings) == 40 and evaluate_warnings[0].endswith("truncated to 3 (--max-source-tokens)")
    assert [w.split(",")[1:] for w in evaluate_warnings] == [w.split(",")[1:] for w in translate_warnings]


@pytest.mark.parametrize("argv, message", [
    (["--split", "nosuchsplit"], "--split nosuchsplit"),
    (["--src", "{prefix}.de"], "--src and --ref go together"),
    (["--src", "{prefix}.de", "--ref", "{short}"], "lines"),
    (["--src", "{missing}", "--ref", "{short}"], "--src {missing}: no such file"),
    (["--src", "{prefix}.de", "--ref", "{folder}"], "--ref {folder}: is a folder, not a file"),
    (["--src", "/dev/null", "--ref", "{short}"], "/dev/null: file is empty"),
    ([], "give --split"),
])
def test_bad_input_is_one_line_and_nonzero(setup, argv, message, tmp_path, capsys):
    folder, prefix, ckpt = setup
    short = tmp_path / "short.en"
    short.write_text("4 5\n", encoding="utf-8")
    names = {"prefix": prefix, "short": short, "missing": tmp_path / "nope.de", "folder": folder}
    argv, message = [a.format(**names) for a in argv], message.format(**names)
    assert main([str(ckpt), *argv, "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def fake_data(n: int):
    srcs = [" ".join(str(t) for t in s) for _, s, _ in random_copy_items(n, seed=21, min_len=4)]
    refs = [s if i % 3 else s + " 7" for i, s in enumerate(srcs)]
    return SimpleNamespace(valid_srcs=srcs, valid_refs=refs, tokenizer=CopyTokenizer(VOCAB))


def expected_scores(data, cfg, n):
    from transformer.decoding import translate_sentences
    hyps = [h[0].text for h in translate_sentences(copy_model(), data.tokenizer, data.valid_srcs[:n], cfg, "cpu")]
    refs = [data.valid_refs[:n]]
    return sacrebleu.corpus_bleu(hyps, refs).score, sacrebleu.corpus_chrf(hyps, refs).score


def test_valid_bleu_single_process():
    data = fake_data(30)
    cfg = EvalConfig(beam=2, bleu_sentences=20)
    got = valid_bleu(copy_model(), data, DistEnv(), cfg)
    bleu, chrf = expected_scores(data, cfg, 20)
    assert got == {"val_bleu": pytest.approx(bleu), "val_chrf": pytest.approx(chrf)}
    assert 0 < got["val_bleu"] < 100


def _worker(rank: int, port: int, state_path: str, out_dir: str):
    torch.set_num_threads(1)
    env = join_gloo(rank, 2, port)
    try:
        from transformer.model import ModelArgs, Transformer
        ckpt = torch.load(state_path, weights_only=True)
        model = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
        got = valid_bleu(model, fake_data(25), env, EvalConfig(beam=2))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.close()


@pytest.mark.distributed
def test_valid_bleu_sharded_over_two_ranks_matches_one_process(tmp_path):
    state = tmp_path / "model.pt"
    torch.save(copy_checkpoint(), state)
    mp.start_processes(_worker, args=(free_port(), str(state), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # every rank returns rank 0's score
    bleu, chrf = expected_scores(fake_data(25), EvalConfig(beam=2), 25)  # an odd count: uneven shards
    assert r0["val_bleu"] == pytest.approx(bleu) and r0["val_chrf"] == pytest.approx(chrf)


@pytest.mark.slow
@needs_multi30k
def test_multi30k_split_via_data_root(tmp_path, capsys):
    """A spaCy-vocabulary model (untrained) evaluated on test_2016_flickr read through load_split."""
    from tests.helpers.models import full_config
    from transformer.config import ModelConfig
    from transformer.data.corpus import read_lines
    from transformer.data.tokenizer import SpacyTokenizer
    from transformer.model import Transformer
    from transformer.training.components.checkpoint import FORMAT

    de = read_lines(MULTI30K / "train.de.gz")[:300]
    en = read_lines(MULTI30K / "train.en.gz")[:300]
    tok = SpacyTokenizer.train(de, en, "de", "en", min_freq=1)
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0), tok.src_vocab_size,
                        tok.tgt_vocab_size)
    ckpt = {"format": FORMAT, "model_args": model.args.to_dict(), "model": model.state_dict(),
            "tokenizer": tok.state_dict(),
            "config": full_config(name="multi30k", root="/nonexistent"), "trainer": {"step": 0}}
    atomic_save(ckpt, tmp_path / "m.pt")
    rc = main([str(tmp_path / "m.pt"), "--split", "test_2016_flickr", "--data-root", str(MULTI30K),
               "--beam", "1", "--max-len-a", "0", "--max-len-b", "5", "--out-dir", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    assert len((tmp_path / "out" / "test_2016_flickr.hyp").read_text(encoding="utf-8").split("\n")) == 1001
