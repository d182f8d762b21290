import subprocess

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.helpers.cli import CONF, cli_env, compose_cfg, train_cmd
from tests.helpers.inprocess import call_main
from transformer.config import ConfigError
from transformer.config_checks import validate


def group_options():
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        for f in sorted(group.glob("*.yaml")):
            yield group.name, f.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_config_option_composes(group, option):
    cfg = compose_cfg(f"{group}={option}")
    OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    assert cfg.model.d_model > 0


def test_paper_base_and_big():
    base = compose_cfg("model=base").model
    assert (base.N, base.d_model, base.d_ff, base.h, base.dropout) == (6, 512, 2048, 8, 0.1)
    big = compose_cfg("model=big").model
    assert (big.N, big.d_model, big.d_ff, big.h, big.dropout) == (6, 1024, 4096, 16, 0.3)


def test_typo_fails_with_full_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("optim.lrr=1")
    assert "Key 'lrr' not in 'OptimConfig'" in str(e.value.__cause__)


def test_wrong_type_fails_with_full_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("model.d_model=big")
    assert "model.d_model" in str(e.value.__cause__)


@pytest.mark.parametrize("override,key", [
    ("model.h=7", "model.d_model"),
    ("model.dropout=1.0", "model.dropout"),
    ("optim.warmup=0", "optim.warmup"),
    ("model.N=0", "model.N"),
    ("model.N_dec=0", "model.N_dec"),
    ("trainer.accumulate=0", "trainer.accumulate"),
    ("trainer.devices=two", "trainer.devices"),
    ("trainer.max_minutes=0", "trainer.max_minutes"),
    ("optim.anneal=1.0", "optim.anneal"),
    ("data.max_tokens_by_epoch=[512,0]", "data.max_tokens_by_epoch"),
    ("trainer.dropout_by_epoch=[0.1,1.0]", "trainer.dropout_by_epoch"),
])
def test_semantic_checks_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg(override))


def test_seen_target_vocabulary_is_full_or_seen_and_refuses_bpe_dropout():
    with pytest.raises(ConfigError, match=r"tokenizer\.tgt_vocab='seen': must be full with data\.bpe_dropout > 0"):
        validate(compose_cfg("experiment=multi30k", "tokenizer.tgt_vocab=seen", "data.bpe_dropout=0.1"))
    with pytest.raises(ConfigError, match=r"tokenizer\.tgt_vocab='sen': must be full or seen"):
        validate(compose_cfg("experiment=multi30k", "tokenizer.tgt_vocab=sen"))
    validate(compose_cfg("experiment=multi30k", "tokenizer.tgt_vocab=seen"))


def test_the_recipe_scores_seen_targets_and_bpe_dropout_needs_the_full_vocabulary():
    """experiment=multi30k sets tokenizer.tgt_vocab=seen; BPE-dropout adds tokenizer.tgt_vocab=full."""
    with pytest.raises(ConfigError, match=r"tokenizer\.tgt_vocab='seen': must be full with data\.bpe_dropout > 0"):
        validate(compose_cfg("experiment=multi30k", "data.bpe_dropout=0.1"))
    validate(compose_cfg("experiment=multi30k", "data.bpe_dropout=0.1", "tokenizer.tgt_vocab=full"))


def test_a_run_needs_a_limit_and_max_minutes_is_one():
    with pytest.raises(ConfigError, match="trainer.max_steps=None: set trainer.max_steps, trainer.max_epochs or"):
        validate(compose_cfg("trainer.max_epochs=null", "trainer.max_steps=null"))
    validate(compose_cfg("trainer.max_epochs=null", "trainer.max_steps=null", "trainer.max_minutes=60"))


def test_anneal_needs_the_run_length_in_steps_or_minutes():
    with pytest.raises(ConfigError, match="optim.anneal=0.3: needs the run's length: set trainer.max_steps or"):
        validate(compose_cfg("optim.anneal=0.3", "trainer.max_epochs=5"))
    validate(compose_cfg("optim.anneal=0.3", "trainer.max_steps=100"))


@pytest.mark.parametrize("override,message", [
    ("optim.lrr=1", "Key 'lrr' not in 'OptimConfig'"),
    ("model.h=7", "model.d_model=512: must be divisible by model.h=7"),
])
def test_bad_override_exits_nonzero_and_writes_nothing(tmp_path, override, message, capfd):
    """transformer-train's main() in this process (test_contract.py starts it as a process on bad input)."""
    from transformer.cli import train as train_cli

    run_dir = tmp_path / "run"
    proc = call_main(train_cli.main, [override, f"hydra.run.dir={run_dir}"], tmp_path, prog="transformer-train",
                     capture=capfd)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["run"])


@pytest.mark.parametrize("overrides,message,devices", [
    (["data=files", "data.files.train=corpus/train", "data.files.val=corpus/val"],
     "corpus file not found: corpus/train.de", "1"),
    (["data=files", "data.files.train=corpus/train", "data.files.val=corpus/val"],
     "corpus file not found: corpus/train.de", "2"),
    (["experiment=multi30k", "data.root=mt", "data.url=http://127.0.0.1:9", "data.download_retries=1"],
     "could not download http://127.0.0.1:9/train.de.gz", "1"),  # one try: no backoff sleeps (1 + 2 + 4 s)
], ids=["missing_corpus", "missing_corpus_spawned", "download_refused"])
def test_bad_data_exits_2_in_one_line_and_leaves_no_run_dir(tmp_path, overrides, message, devices, capfd):
    """Errors found after the config passed (corpus files, downloads), on one worker or in spawned workers:
    one `error:` line naming the file or URL, exit code 2, and no run directory left behind. The spawned workers'
    case starts the command as a process, the others run its main() in this process."""
    from transformer.cli import train as train_cli

    env = {**cli_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = [*overrides, f"trainer.devices={devices}", "trainer.accelerator=cpu", "trainer.progress=false"]
    if devices == "1":
        proc = call_main(train_cli.main, argv, tmp_path, env=env, prog="transformer-train", capture=capfd)
    else:
        proc = subprocess.run(train_cmd(*argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))


def test_attention_dropout_out_of_range_is_refused_with_its_key():
    from transformer.config import ConfigError
    from transformer.config_checks import validate

    with pytest.raises(ConfigError, match=r"model.attention_dropout=1.0: must be in \[0, 1\)"):
        validate(compose_cfg("model.attention_dropout=1.0"))
    validate(compose_cfg("model.attention_dropout=0"))
    validate(compose_cfg("model.attention_dropout=null"))


def test_shape_steps_off_the_ladders_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"trainer.shape_steps=3: must be one of 2, 4, 8, 16"):
        validate(compose_cfg("trainer.shape_steps=3"))
    validate(compose_cfg("trainer.shape_steps=8", "trainer.static_shapes=true"))


def test_compile_scope_other_than_model_or_layers_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"trainer.compile_scope='layer': must be model or layers"):
        validate(compose_cfg("trainer.compile_scope=layer"))
    validate(compose_cfg("trainer.compile=true", "trainer.compile_scope=layers"))


def test_ffn_dropout_out_of_range_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"model.ffn_dropout=1.0: must be in \[0, 1\), or null"):
        validate(compose_cfg("model.ffn_dropout=1.0"))
    validate(compose_cfg("model.ffn_dropout=0"))
