"""Experiment trackers beside metrics.jsonl: TensorBoard (the default), Weights & Biases and MLflow, chosen by
`logger.trackers`. Only global rank 0 ever creates one (transformer/training/reporting/logs.py's MetricsLogger).

wandb and mlflow are optional extras (`pip install 'transformer[wandb]'`, `'.[mlflow]'`):
`transformer.config_checks.check_logger` refuses a tracker whose library is missing before the run directory is made.
A tracker run starts at the run's first event (or at its end, to record a failure) with the whole resolved
config, receives every numeric, finite value of every event as `<split>/<name>` at the event's step (what
TensorBoard gets), and at the end records the exit code (transformer/exit_codes.py) and its status name.
The tracker run ids are kept in <run_dir>/trackers.json: a later launch into the same run directory (a resume
after preemption) continues the same tracker runs, as it continues metrics.jsonl.
"""
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Dict, Optional

from transformer import exit_codes
from transformer.atomic import write_text_atomic

log = logging.getLogger("transformer")
IDS_FILE = "trackers.json"  # {tracker: run id} of the run directory


def exit_status(code: int) -> str:
    return {exit_codes.OK: "success", exit_codes.PREEMPTED: "preempted", exit_codes.USER_ERROR: "bad_input",
            exit_codes.DIVERGED: "diverged", exit_codes.ENVIRONMENT: "environment",
            exit_codes.ABORTED: "aborted"}.get(code, "failed")


def numeric(values: dict) -> Dict[str, float]:
    """The values a tracker plots: numbers (not booleans) that are finite."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _flatten(d: dict, prefix: str = "") -> Dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class WandbTracker:
    def __init__(self, cfg, run_dir: Path, config: dict, resume_id: Optional[str] = None):
        import wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, name=cfg.name or run_dir.name,
                              group=cfg.group, tags=list(cfg.tags) or None, dir=str(run_dir),
                              id=resume_id, resume="allow" if resume_id else None,
                              settings=wandb.Settings(console="off"))  # our own console and train.log stay as they are
        self.run.config.update(config, allow_val_change=True)  # a resume may change settings (the launcher warns)
        self.id = self.run.id
        log.info("wandb: run %s%s in %s", self.id, " (continued)" if resume_id else "", self.run.dir)

    def log(self, split: str, step: int, values: Dict[str, float]) -> None:
        self.run.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

    def close(self, code: int) -> None:
        self.run.summary["exit_code"] = code
        self.run.summary["exit_status"] = exit_status(code)
        self.run.finish(exit_code=code)


class MlflowTracker:
    BATCH = 100  # params per request (MLflow's limit per log_batch)

    def __init__(self, cfg, run_dir: Path, config: dict, resume_id: Optional[str] = None):
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.absolute() / "mlruns").as_uri()
        if uri.startswith("file:"):  # asked for by name: newer MLflow refuses file stores without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self.id = resume_id if resume_id and self._exists(resume_id) else None
        if self.run_id is not None:  # params are immutable in MLflow: those of the first launch stay
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("mlflow: run %s (continued) at %s", self.run_id, uri)
            return
        exp = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.experiment)
        self.run_id = self.id = self.client.create_run(exp_id, run_name=cfg.run_name or run_dir.name,
                                                       tags={"run_dir": str(run_dir.absolute())}).info.run_id
        params = [Param(k, v[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])
        self.client.log_dict(self.run_id, config, "config.json")
        log.info("mlflow: run %s at %s", self.run_id, uri)

    def _exists(self, run_id: str) -> bool:
        """Whether this store has the run (a changed logger.mlflow.tracking_uri starts a new one)."""
        from mlflow.exceptions import MlflowException
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def log(self, split: str, step: int, values: Dict[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{split}/{k}", v, now, step) for k, v in values.items()])

    def close(self, code: int) -> None:
        self.client.set_tag(self.run_id, "exit_code", str(code))
        self.client.set_tag(self.run_id, "exit_status", exit_status(code))
        status = {exit_codes.OK: "FINISHED", exit_codes.PREEMPTED: "KILLED"}.get(code, "FAILED")
        self.client.set_terminated(self.run_id, status)


def open_trackers(cfg_logger, run_dir: Path, config: dict) -> list:
    """The wandb/mlflow trackers `logger.trackers` names (TensorBoard is MetricsLogger's own writer). One that
    cannot start (no login, a server out of reach, a bad URI) is bad input: a ValueError naming its keys."""
    classes = {"wandb": (WandbTracker, cfg_logger.wandb), "mlflow": (MlflowTracker, cfg_logger.mlflow)}
    opened, ids = [], _saved_ids(run_dir)
    for name in cfg_logger.trackers:
        if name in classes:
            try:
                opened.append(classes[name][0](classes[name][1], run_dir, config, ids.get(name)))
                ids[name] = opened[-1].id
            except Exception as e:
                for tracker in opened:
                    close_quietly(tracker, exit_codes.USER_ERROR)
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"logger.trackers: {name} could not start a run ({type(e).__name__}: {first}); "
                                 f"check logger.{name}.* and the {name} login/server, or drop it from "
                                 "logger.trackers") from None
    if opened:
        write_text_atomic(run_dir / IDS_FILE, json.dumps(ids, indent=1) + "\n")
    return opened


def _saved_ids(run_dir: Path) -> Dict[str, str]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):  # none yet, or unreadable: new tracker runs
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def close_quietly(tracker, code: int) -> None:
    """Records the end; a tracker that fails to (a server gone) is a warning, never the run's failure."""
    try:
        tracker.close(code)
    except Exception as e:
        log.warning("%s could not record the end of the run: %s: %s", type(tracker).__name__, type(e).__name__, e)
