"""logger.trackers: Weights & Biases (offline mode) and MLflow (a local file store) receive exactly the series of
metrics.jsonl, the run's config and how it ended; a missing library is refused before anything is written.
Nothing here reaches a server: wandb runs offline with its server address pointed at a closed local port."""
import json
import math
import os
import signal
import struct
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg, train_cmd
from tests.helpers.dist import TINY, env_for, finish, popen, run_cli, step_files, wait_for
from transformer import exit_codes
from transformer.config import Config, ConfigError
from transformer.config_checks import check_logger
from transformer.training.reporting.trackers import exit_status

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

@pytest.fixture(autouse=True)
def _mlflow_file_store(monkeypatch):
    """Reading a file store back in this process needs MLflow's opt-in too (newer versions refuse file stores)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


SHORT = ("trainer.max_steps=6", "trainer.val_every=3", "checkpoint.every_steps=3", "trainer.accelerator=cpu")


def offline_env(tmp_path: Path) -> dict:
    """wandb offline and silent, every folder of its own under tmp_path, no key, a server that cannot answer."""
    home = tmp_path / "wandb-home"
    env = env_for(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(home), WANDB_CACHE_DIR=str(home / "cache"),
                  WANDB_CONFIG_DIR=str(home / "config"), WANDB_DATA_DIR=str(home / "data"),
                  WANDB_BASE_URL="http://127.0.0.1:9", MLFLOW_ALLOW_FILE_STORE="true")
    for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    return env


# ---- reading back what the trackers stored -------------------------------------------------------------
def wandb_records(path: Path):
    """The records of an offline .wandb file: a LevelDB-style log of 32 KiB blocks after a 7-byte header,
    each record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf
    `Record` (wandb.proto.wandb_internal_pb2)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(run_dir: Path) -> dict:
    """{"series": {key: [(step, value)]}, "config": {...}, "summary": {...}, "exit_code": int, "ids": [...]}
    over the run directory's offline runs in time order (a resumed run adds one, with the same id)."""
    out = {"series": {}, "config": {}, "summary": {}, "exit_code": None, "ids": []}
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    records = [r for path in files for r in wandb_records(path)]
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["ids"].append(r.run.run_id)
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for k, v in items.items():
                if not k.startswith("_"):
                    out["series"].setdefault(k, []).append((items["_step"], v))
        elif kind in ("run", "config"):
            updates = r.run.config.update if kind == "run" else r.config.update
            out["config"].update({i.key: json.loads(i.value_json) for i in updates})
        elif kind == "summary":
            out["summary"].update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("transformer").experiment_id])
    series = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
              for k in run.data.metrics}
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "config.json")).read_text())
    return run, series, config


def jsonl_series(run_dir: Path) -> dict:
    """metrics.jsonl as the trackers should have it: every finite number of an event as split/name per step."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k in ("split", "step", "epoch", "elapsed_s"):
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(f"{rec['split']}/{k}", []).append((rec["step"], v))
    return out


def assert_same_series(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]], k
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in want[k]], rel=1e-12), k


# ---- tests ---------------------------------------------------------------------------------------------
def test_check_logger_names_the_key(monkeypatch):
    cfg = OmegaConf.structured(Config).logger
    check_logger(cfg)  # the default: TensorBoard
    for trackers, message in ((["tensorboard", "comet"], "'comet' is not one of tensorboard, wandb, mlflow"),
                              (["wandb", "wandb"], "listed twice")):
        cfg.trackers = trackers
        with pytest.raises(ConfigError, match=rf"^logger.trackers=.*{message}"):
            check_logger(cfg)
    cfg.trackers = ["mlflow"]
    cfg.wandb.mode = "offlien"
    with pytest.raises(ConfigError, match="^logger.wandb.mode='offlien'"):
        check_logger(cfg)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg.wandb.mode = None
    with pytest.raises(ConfigError, match=r"^logger.trackers=\['mlflow'\]: mlflow needs the mlflow package.*"
                                          r"pip install 'transformer\[mlflow\]'"):
        check_logger(cfg)


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_library_is_one_line_exit_2_before_anything_is_written(tmp_path, tracker, monkeypatch, capsys):
    """The library hidden from the import system: refused with the key and the pip extra, no run directory.
    transformer-train runs in this process (the refusal comes before any worker), so the hiding holds."""
    import importlib.util

    from transformer.cli import train as train_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == tracker else real(n, *a))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["transformer-train", *TINY, *SHORT, f"logger.trackers=[tensorboard,{tracker}]",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as end:
        train_cli.main()
    err = capsys.readouterr().err
    assert end.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: logger.trackers=") and \
        f"pip install 'transformer[{tracker}]'" in lines[0], err
    assert not (tmp_path / "run").exists() and list(tmp_path.iterdir()) == []


def test_wandb_and_mlflow_get_the_series_config_and_success(tmp_path):
    run = tmp_path / "run"
    uri = (tmp_path / "mlruns").as_uri()
    run_cli(train_cmd(*TINY, *SHORT, "logger.trackers=[tensorboard,wandb,mlflow]", f"logger.mlflow.tracking_uri={uri}",
                      "logger.wandb.tags=[ci]", f"hydra.run.dir={run}"), tmp_path, env=offline_env(tmp_path))
    want = jsonl_series(run)
    assert {"train/loss", "train/lr", "valid/val_loss", "test/test_accuracy"} <= set(want)
    assert len(want["train/loss"]) == 6

    w = wandb_run(run)
    assert_same_series(w["series"], want)
    assert w["config"]["model"]["d_model"] == 32 and w["config"]["trainer"]["max_steps"] == 6
    assert w["exit_code"] == 0 and w["summary"]["exit_status"] == "success" and w["summary"]["exit_code"] == 0
    assert (run / "tensorboard").is_dir() and not (tmp_path / "wandb-home" / "wandb").exists()  # all in the run dir

    m, series, config = mlflow_run(uri)
    assert_same_series(series, want)
    assert config["model"]["d_model"] == 32 and m.data.params["model.d_model"] == "32"
    assert m.info.status == "FINISHED" and m.data.tags["exit_status"] == "success" and m.data.tags["exit_code"] == "0"
    assert m.info.run_name == "run"


@pytest.mark.slow
def test_a_preempted_run_is_recorded_as_such_and_its_resume_continues_it(tmp_path):
    run = tmp_path / "run"
    args = (*TINY, "checkpoint.every_steps=5", "trainer.val_every=100000", "trainer.accelerator=cpu",
            "logger.trackers=[wandb,mlflow]", f"hydra.run.dir={run}")
    proc = popen(train_cmd(*args, "trainer.max_steps=100000"), tmp_path, env=offline_env(tmp_path))
    wait_for(lambda: step_files(run), 180, "the first checkpoint", proc)
    os.kill(proc.pid, signal.SIGTERM)
    err = finish(proc)
    assert proc.returncode == exit_codes.PREEMPTED, err[-4000:]
    assert not (run / "tensorboard").exists()  # not among the trackers

    w = wandb_run(run)
    assert w["exit_code"] == exit_codes.PREEMPTED and w["summary"]["exit_status"] == "preempted"
    assert_same_series(w["series"], jsonl_series(run))
    m, series, _ = mlflow_run((run / "mlruns").as_uri())  # the default store: the run directory
    assert m.info.status == "KILLED" and m.data.tags["exit_status"] == "preempted"
    assert_same_series(series, jsonl_series(run))

    stopped = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    run_cli(train_cmd(*args, f"trainer.max_steps={stopped + 3}"), tmp_path, env=offline_env(tmp_path))
    w = wandb_run(run)  # the resumed launch continues the same wandb run, and the same MLflow run
    assert len(w["ids"]) == 2 and len(set(w["ids"])) == 1
    assert w["exit_code"] == 0 and w["summary"]["exit_status"] == "success"
    assert_same_series(w["series"], jsonl_series(run))
    m, series, _ = mlflow_run((run / "mlruns").as_uri())
    assert m.info.status == "FINISHED" and m.data.tags["exit_status"] == "success"
    assert_same_series(series, jsonl_series(run))
    assert max(s for s, _ in series["train/loss"]) == stopped + 3


def test_a_failure_is_recorded_as_failed(tmp_path, monkeypatch):
    """MetricsLogger.close(code) with the code of a crash: the trackers say failed (the launcher passes it)."""
    from transformer.training.reporting.logs import MetricsLogger
    for k, v in offline_env(tmp_path).items():
        if k.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = compose_cfg("experiment=copy", "logger.trackers=[wandb,mlflow]")
    run = tmp_path / "run"
    logger = MetricsLogger(run, cfg)
    logger.log("train", 1, 0, loss=2.5, lr=0.1, flag=True, note="text")
    logger.log("train", 2, 0, loss=float("nan"), lr=0.2)
    logger.close(exit_codes.INTERNAL)
    w = wandb_run(run)
    assert w["exit_code"] == exit_codes.INTERNAL and w["summary"]["exit_status"] == "failed"
    assert w["series"] == {"train/loss": [(1, 2.5)], "train/lr": [(1, 0.1), (2, 0.2)]}  # numbers, finite ones
    m, series, _ = mlflow_run((run / "mlruns").as_uri())
    assert m.info.status == "FAILED" and m.data.tags["exit_code"] == str(exit_codes.INTERNAL)
    assert series == w["series"]
    assert [exit_status(c) for c in (0, 1, 2, 3, 4, 5, 130)] == ["success", "failed", "bad_input", "preempted",
                                                             "diverged", "environment", "aborted"]

    quiet = tmp_path / "quiet"  # failed before its first event: the trackers still hear of it
    quiet.mkdir()
    MetricsLogger(quiet, cfg).close(exit_codes.USER_ERROR)
    assert wandb_run(quiet)["summary"]["exit_status"] == "bad_input" and not (quiet / "metrics.jsonl").exists()
    m, series, _ = mlflow_run((quiet / "mlruns").as_uri())
    assert m.info.status == "FAILED" and m.data.tags["exit_status"] == "bad_input" and series == {}


def test_a_tracker_that_cannot_start_is_bad_input(tmp_path, monkeypatch):
    """wandb online without a login (the server address a closed local port): a ValueError naming the keys."""
    from transformer.training.reporting.trackers import open_trackers
    for k, v in offline_env(tmp_path).items():
        if k.startswith("WANDB_"):
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    cfg = compose_cfg("experiment=copy", "logger.trackers=[wandb]", "logger.wandb.mode=online").logger
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match=r"^logger.trackers: wandb could not start a run \(.*\); check logger.wandb"):
        open_trackers(cfg, tmp_path / "run", {"seed": 1})
