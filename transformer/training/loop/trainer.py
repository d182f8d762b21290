"""The trainer: one instance per worker, the same code for 1 CPU process and N distributed GPUs.

Its `state_dict()` is the checkpoint: model, optimiser, schedule, grad scaler, step, epoch, position
in the epoch's batch list, best metric, and the RNG state of every rank. Restoring it continues
the run exactly where it stopped.
"""
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from transformer import exit_codes
from transformer.config import to_container
from transformer.data.shapes import static_shape
from transformer.dist import DistEnv, rank_zero
from transformer.tasks import Task
from transformer.training.components.checkpoint import (
    FORMAT,
    Checkpointer,
    CheckpointError,
)
from transformer.training.components.ema import EMA
from transformer.training.components.init_from import FREE_AT_INIT, override_value
from transformer.training.components.optim import build_optimizer, fall_steps, load_optimizer_state
from transformer.training.distributed.parallelize import Parallelized
from transformer.training.loop.hotpath import LaggedFlag, LoopKeys, StepResult, TrainWindow, paused
from transformer.training.loop.nonfinite import Diverged, NonfiniteGuard, check_weights, diverged_line
from transformer.training.loop.quality import RunClock, TimeToQuality
from transformer.training.loop.run_end import end_of_run
from transformer.training.loop.step import build_step
from transformer.training.loop.validation import Validator, rng_untouched
from transformer.training.reporting.logs import MetricsLogger, Progress, gpu_stats
from transformer.training.speed import speedups
from transformer.training.speed.graphs import GraphStep

log = logging.getLogger(__name__)


class Trainer:
    """One worker's training: Adam with the schedule of paper Section 5.3, label-smoothed loss (Section 5.4),
    accumulation of trainer.accumulate micro-batches (src (B, S), tgt_in/tgt_out (B, T) -> logits (B, T, V))
    per step, validation and checkpoints on a schedule. The launcher builds one per rank and calls `train()`.

    Args:
        cfg: the run's config (all sections).
        env: the distributed environment (rank, world size, device, collectives).
        parallel: what `parallelize(model, cfg, env)` returned (model, wrapped module, precision).
        data: the DataModule: this rank's train and valid loaders, the tokenizer.
        task: the Task: validation scores, checkpoint.best_metric's declaration, final scores.
        run_dir: the run directory on global rank 0; None elsewhere and for runs that write nothing.
        stop: a launcher.StopRequest (`.signum` set by SIGTERM/SIGUSR1): the run ends cleanly, checkpointed.
    """

    def __init__(self, cfg, env: DistEnv, parallel: Parallelized, data, task: Task, run_dir: Optional[Path],
                 stop=None):
        self.cfg, self.env, self.data, self.task, self.run_dir = cfg, env, data, task, run_dir
        self.stop = stop
        self.tcfg = cfg.trainer
        self.keys = LoopKeys.of(cfg)  # what every step reads
        self.parallel = parallel
        self.model, self.net = parallel.model, parallel.net  # the module, and what the training step calls
        self.amp_dtype, self.scaler = parallel.amp_dtype, parallel.scaler
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.model.d_model,
                                                         capturable=self.tcfg.cuda_graphs)
        self.pad_multiple = speedups.pad_multiple(self.tcfg)
        # micro-batches per step, and trainer.micro_batch=fit's choice (experimental/microbatch.py), checkpointed
        self.accumulate, self.micro_batch = self.tcfg.accumulate, None
        data.packings = self.tcfg.unpadded_attention  # its batches carry host-made packings: no host sync
        self.static_shapes = self.tcfg.static_shapes or self.tcfg.cuda_graphs  # transformer/data/shapes.py
        if self.static_shapes and self.tcfg.unpadded_attention:  # packed token budgets (experimental/packed.py)
            data.use_packed_budgets(self.tcfg.shape_steps)
        elif self.static_shapes:
            data.use_static_shapes(self.tcfg.shape_steps)
        self.step = self.epoch = self.batch_index = 0
        self.total_steps: Optional[int] = None  # set by train(), for the ETA
        self.metric = task.metric(cfg.checkpoint.best_metric)  # checked against what the task measures
        self.clock, self.quality = RunClock(), TimeToQuality(task.metrics().values())
        self._dropout = self.model.args.dropout  # P_drop the model now has
        self.out_of_time = False  # trainer.max_minutes passed: read with the stop flag, two steps late
        self._batch_counts = {}  # token budget -> batches of one epoch (_batches_of)
        self.ema = EMA(self.model, self.tcfg.ema_decay) if self.tcfg.ema_decay > 0 else None
        self.checkpointer = Checkpointer(run_dir, cfg.checkpoint.keep_last) if run_dir is not None else None
        self.metrics = MetricsLogger(run_dir, cfg)
        self.validator = Validator(task, data, env, self.metrics, metric=self.metric,
                                   label_smoothing=self.tcfg.label_smoothing, patience=cfg.eval.patience,
                                   autocast=parallel.autocast, clock=self.clock, quality=self.quality)
        self.guard = NonfiniteGuard(self.tcfg, self.optimizer, self.scaler)  # trainer.nonfinite
        # one optimiser step, eager or CUDA-graphed (transformer/training/loop/step.py)
        self.stepper = build_step(parallel, self.optimizer, self.scheduler, self.guard, env, self.tcfg,
                                  self.pad_multiple, self.static_shapes)

    @property
    def graphs(self) -> Optional[GraphStep]:
        """The CUDA graphs of the step under trainer.cuda_graphs (run eagerly on a CPU), else None."""
        return self.stepper.graphs

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Collective (every rank must call it): RNG states of all ranks are gathered to rank 0."""
        rng = {"cpu": torch.get_rng_state()}
        if self.env.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.env.device)
        rngs = self.env.gather_objects(rng)
        return {
            "format": FORMAT,
            "model_args": self.model.args.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "trainer": {"step": self.step, "epoch": self.epoch, "batch_index": self.batch_index,
                        "best": self.validator.best, "bad_validations": self.validator.bad_validations,
                        "world_size": self.env.world_size, "metric": self.metric.name,
                        "clock": self.clock.state_dict(), "time_to_quality": self.quality.state_dict(),
                        "micro_batch": self.micro_batch, "amp_dtype": str(self.amp_dtype).replace("torch.", "")},
            "rng": rngs,
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            "tokenizer": self.data.tokenizer.state_dict(),
            "config": to_container(self.cfg),
        }

    def load_state_dict(self, ckpt: dict, path: str = "checkpoint") -> None:
        t = ckpt["trainer"]
        if t["world_size"] != self.env.world_size:
            raise CheckpointError(
                f"{path} was written by {t['world_size']} workers but this run has {self.env.world_size}: the batch "
                "order depends on the worker count, so an exact resume is impossible. Rerun with the same number "
                "of workers, or start a new run from its weights with trainer.init_from=PATH")
        self.load_weights(ckpt, path)
        load_optimizer_state(self.optimizer, ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.epoch, self.batch_index = t["step"], t["epoch"], t["batch_index"]
        self.validator.best, self.validator.bad_validations = t["best"], t["bad_validations"]
        self.micro_batch = t.get("micro_batch")  # applied by microbatch.fit_micro_batch
        if self.ema is not None:
            if "ema" not in ckpt:
                raise CheckpointError(f"{path} holds no weight average but trainer.ema_decay={self.tcfg.ema_decay}: "
                                      "resume with trainer.ema_decay=0, or start a new run with trainer.init_from")
            self.ema.load_state_dict(ckpt["ema"])
        self.clock.load_state_dict(t.get("clock", {}))  # absent from checkpoints of earlier versions
        self.quality.load_state_dict(t.get("time_to_quality", {}))
        rng = ckpt["rng"][self.env.rank]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.env.device)

    def load_weights(self, ckpt: dict, path: str, free: tuple = ()) -> None:
        """The checkpoint's weights, whose model args must equal this model's except for the keys in `free`
        (trainer.init_from frees `dropout`: a rate, not a weight)."""
        mine = {k: v for k, v in self.model.args.to_dict().items() if k not in free}
        theirs = {k: v for k, v in ckpt["model_args"].items() if k not in free}
        if theirs != mine:
            diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
            # rates alone (model=base and big once had other defaults): the command line gives them back
            rates = " ".join(f"model.{k}={override_value(old)}" for k, (old, _) in diff.items())
            hint = f"; to resume it as it was trained, add {rates}" if set(diff) <= set(FREE_AT_INIT) else ""
            raise CheckpointError(f"{path} holds another model (checkpoint vs config: {diff}){hint}")
        self.model.load_state_dict(ckpt["model"])
        if self.ema is not None:  # the average starts from these weights, not the random ones (a resume loads its own)
            self.ema.load_state_dict({"updates": 0, "shadow": self.model.state_dict()})

    # ---- training ----------------------------------------------------------------------------------
    def train(self) -> int:
        """Runs until max_steps/max_epochs/max_minutes, early stop or a stop signal; after a normal end, the
        end of run (run_end.end_of_run). Collective.

        Returns:
            The process exit code (transformer/exit_codes.py): 0, or PREEMPTED after a stop signal.
        """
        if self._stop_before_start():
            return exit_codes.PREEMPTED
        self.clock.start()
        self.scheduler.plan_anneal(self.tcfg.max_steps)  # after a resume: a fall already begun is kept
        self.total_steps = self._total_steps()
        progress = Progress(self.total_steps, self.step, self.tcfg.progress)
        try:
            code = self._loop(progress)
        except Diverged as e:  # the same step on every rank: the flag is all-reduced, the weights are the same
            code = self._diverged(e.why)
        finally:
            progress.close()
        if code == 0:
            end_of_run(self.model, self.validator, cfg=self.cfg, env=self.env, task=self.task, data=self.data,
                       checkpointer=self.checkpointer, metrics=self.metrics, run_dir=self.run_dir, step=self.step,
                       epoch=self.epoch, clock=self.clock)
        return code

    def _total_steps(self) -> Optional[int]:
        """The progress bar's total (for its ETA): max_steps, or the steps of max_epochs if they come first.
        An epoch takes ceil(batches / accumulate) steps. Its batch count varies by one or two between epochs
        of the same token budget, so each budget of data.max_tokens_by_epoch is planned once and the total
        is an estimate; the epochs already run count as the steps they took."""
        t = self.tcfg
        totals = [] if t.max_steps is None else [t.max_steps]
        if t.max_epochs is not None:
            total = self.step - math.ceil(self.batch_index / self.accumulate)
            for epoch in range(self.epoch, t.max_epochs):
                total += math.ceil(self._batches_of(epoch) / self.accumulate)
            totals.append(total)
        return min(totals) if totals else None

    def _batches_of(self, epoch: int) -> int:
        """Epoch `epoch`'s batch count, counted once per token budget of data.max_tokens_by_epoch (it varies by
        one or two between epochs of the same budget, so later epochs' counts are estimates)."""
        tokens = self.data.train_sampler.tokens_of(epoch)
        if tokens not in self._batch_counts:
            self._batch_counts[tokens] = self.data.num_train_batches(epoch)
        return self._batch_counts[tokens]

    @property
    def stop_signal(self) -> Optional[int]:
        return self.stop.signum if self.stop is not None else None

    def _stop_before_start(self) -> bool:
        """A stop signal that came while the data and model were being prepared: no step has run since the
        last checkpoint (if any), so there is nothing new to save."""
        if not self.env.all_reduce_sum([float(self.stop_signal is not None)])[0]:
            return False
        rank_zero(log.warning)("stopped by a signal before training started (step %d): nothing new to save, "
                               "exit code %d; rerun the same command to %s", self.step, exit_codes.PREEMPTED,
                               "resume" if self.step else "start")
        return True

    def _done(self) -> bool:
        t = self.keys
        return ((t.max_steps is not None and self.step >= t.max_steps)
                or (t.max_epochs is not None and self.epoch >= t.max_epochs) or self.out_of_time
                or self.scheduler.annealed)

    def _time_flags(self) -> tuple:
        """(late, anneal): this rank's run clock is past trainer.max_minutes, or past the start of the
        rate's fall, (1 - optim.anneal) * max_minutes. Raised here, acted on once all-reduced."""
        keys = self.keys
        if keys.max_minutes is None:
            return False, False
        seconds, limit = self.clock.seconds(), 60 * keys.max_minutes
        return seconds >= limit, keys.anneal > 0 and seconds >= limit * (1 - keys.anneal)

    def _set_dropout(self) -> None:
        """trainer.dropout_by_epoch: this epoch's P_drop (set again on resume, from the restored epoch)."""
        schedule = self.tcfg.dropout_by_epoch
        p = schedule[self.epoch] if self.epoch < len(schedule) else self.model.args.dropout
        if schedule and p != self._dropout:
            log.info("epoch %d: dropout %g (trainer.dropout_by_epoch, then model.dropout)", self.epoch, p)
            self.model.set_dropout(p)
        self._dropout = p

    def _loop(self, progress: Progress) -> int:
        window = TrainWindow()
        code = self._run_steps(progress, window)
        if code == 0 and window.steps:  # the steps since the last line (all of a run shorter than log_every)
            self._log_train(window, None)
        return code

    def _run_steps(self, progress: Progress, window: TrainWindow) -> int:
        K = self.accumulate
        stop_flag = LaggedFlag()
        # Resumed at or past its time limit (to finish an interrupted end of run, say), a run trains no step:
        # the flag would end it two steps later. The restored clock is the same on every rank, so all agree.
        if self.tcfg.max_minutes is not None and self.clock.before >= 60 * self.tcfg.max_minutes:
            self.out_of_time = True
        while not self._done():
            self._set_dropout()
            n = self.data.num_train_batches(self.epoch)
            with self._rng_untouched():  # a DataLoader iterator draws its seed from the global RNG
                batches = iter(self.data.train_loader(self.epoch, start=self.batch_index))
            while self.batch_index < n and not self._done():
                micro = [next(batches) for _ in range(min(K, n - self.batch_index))]
                result, stop = self._train_step(micro, window, stop_flag)
                # The bar shows the last logged line's loss: reading it every step would sync every step.
                logged = self.step % self.keys.log_every == 0
                progress.update(**(self._log_train(window, result.grad_norm) if logged else {}))
                if stop:
                    self.save(is_best=False)
                    # rank 0's line: only it knows the run directory (other ranks' is None)
                    rank_zero(log.warning)("stopped by a signal at step %d; checkpoint written, exit code %d; rerun "
                                           "the same command with hydra.run.dir=%s to resume", self.step,
                                           exit_codes.PREEMPTED, self.run_dir)
                    return exit_codes.PREEMPTED
                validated = is_best = False
                if self.step % self.keys.val_every == 0:
                    validated, is_best = True, self._validate_once(window)
                if is_best or self.step % self.keys.every_steps == 0:
                    self._save_between_steps(window, is_best)  # a new best at once, or best.pt would miss it
                if validated and self._patience_over():
                    return 0
            if self.batch_index >= n:  # epoch complete (not cut short by max_steps)
                self.epoch, self.batch_index = self.epoch + 1, 0
                if self.tcfg.val_epoch_end:  # off: val_every and checkpoint.every_steps alone pace both
                    self._save_between_steps(window, self._validate_once(window))
                    if self._patience_over():
                        return 0
        if self.scheduler.annealed and not self.out_of_time:
            log.info("optim.anneal: the learning rate reached 0 at step %d (%.1f min)", self.step,
                     self.clock.seconds() / 60)
        if self.out_of_time:
            log.info("trainer.max_minutes=%g reached at step %d (%.1f min); a larger value (or null) on the same "
                     "run directory trains on", self.tcfg.max_minutes, self.step, self.clock.seconds() / 60)
        if not self._last_saved_is_current():  # stopped by max_steps or max_minutes mid-epoch
            self._save_between_steps(window, self._validate_once(window))
        return 0

    def _rng_untouched(self):
        return rng_untouched(self.env.device)  # validation.rng_untouched says why

    def _validate_once(self, window: TrainWindow) -> bool:
        """Validates this step's weights (the weight average with trainer.ema_decay), once per step;
        returns whether they are the best so far. Its time is not the steps' (`paused`)."""
        with paused(window, self.clock, "validation", self.env.device):
            return self.validator(self.model, self.step, self.epoch, self.ema)

    def _save_between_steps(self, window: TrainWindow, is_best: bool) -> None:
        with paused(window, self.clock, "checkpoints", self.env.device):
            self.save(is_best)

    def _patience_over(self) -> bool:
        return self.validator.patience_over()

    def autocast(self):
        """The forward pass's autocast context (trainer.precision), the same for training and validation."""
        return self.parallel.autocast()

    def _train_step(self, micro, window: TrainWindow, stop_flag: LaggedFlag):
        """One optimiser step and its bookkeeping, with no host sync. Returns the step's result and the
        flags of two steps before (read late: transformer/training/loop/hotpath.py), the same on all ranks."""
        result = self._optimizer_step(micro)
        if self.ema is not None:
            self.ema.update()
        self.batch_index += len(micro)
        self.step += 1
        window.add(result)
        stop, self.out_of_time, anneal, nonfinite = stop_flag.push(result.flags)  # one copy for the four
        self.guard.observe(nonfinite, self.step - stop_flag.lag)  # the flag's step; may raise Diverged
        if anneal and not self.scheduler.falling:
            this_epoch = self.data.num_train_batches(self.epoch)  # exact, where _batches_of estimates
            steps = fall_steps(self.cfg.optim.anneal, self.epoch, self.batch_index, self.accumulate,
                               lambda e: this_epoch if e == self.epoch else self._batches_of(e))
            self.scheduler.anneal_now(steps)
        return result, stop

    def _optimizer_step(self, micro) -> StepResult:
        """One optimiser step over the micro-batches `micro` (transformer/training/loop/step.py), no host sync."""
        return self.stepper(micro, self._static_shape, self._dropout,
                               lambda: (self.stop_signal is not None, *self._time_flags()))

    def _static_shape(self, batch) -> Optional[tuple]:
        """trainer.static_shapes: the (rows, S, T) this epoch's batch is padded to (transformer/data/shapes.py)."""
        if not self.static_shapes or batch.src.dim() == 1:  # a packed batch has its budget's shape already
            return None
        budget = self.data.train_sampler.tokens_of(self.epoch)
        return static_shape(batch.src.size(1), batch.tgt_in.size(1), budget, self.keys.max_sentences,
                            self.keys.shape_steps)

    def _log_train(self, window: TrainWindow, grad_norm: Optional[torch.Tensor]) -> dict:
        """Logs the window's averages (its one host sync) and returns what the progress bar shows."""
        w = window.read(grad_norm)
        elapsed, tokens = w["elapsed"], max(w["tokens"], 1.0)
        values = {"loss": w["loss"] / tokens, "nll": w["nll"] / tokens,
                  "ppl": math.exp(min(w["nll"] / tokens, 50)), "lr": self.scheduler.lr(),
                  "tokens_per_s": w["tokens"] / max(elapsed, 1e-9)}
        if grad_norm is not None:
            values["grad_norm"] = w["grad_norm"]
        ends = [s for s in (self.total_steps, self.scheduler.anneal_end) if s is not None]
        if ends:  # for logs read without the bar (SLURM, nohup): time left at this pace
            values["eta_s"] = max(min(ends) - self.step, 0) * w["wall"] / max(w["steps"], 1)  # pauses too
        if self.tcfg.max_minutes is not None:  # the time limit may come first
            left = max(60 * self.tcfg.max_minutes - self.clock.seconds(), 0.0)
            values["eta_s"] = min(values.get("eta_s", left), left)
        values.update(gpu_stats(self.env.device))
        self.metrics.log("train", self.step, self.epoch, **values)
        window.reset()
        return {"loss": values["loss"], "lr": values["lr"], "tok/s": values["tokens_per_s"]}

    # ---- checkpoints -------------------------------------------------------------------------------
    def _last_saved_is_current(self) -> bool:
        files = self.checkpointer.step_files() if self.checkpointer is not None else []
        return self.env.broadcast_object(bool(files) and files[0][0] == self.step)

    def save(self, is_best: bool) -> None:
        check_weights([*self.model.parameters(), *(self.ema.shadow.values() if self.ema is not None else [])],
                      self.step)
        state = self.state_dict()  # collective
        self._write(state, is_best)
        self.env.barrier()  # nobody runs ahead (or exits) before the file is on disk

    @rank_zero
    def _write(self, state: dict, is_best: bool) -> None:
        if self.checkpointer is not None:
            path = self.checkpointer.save(state, self.step, is_best)
            log.info("checkpoint %s%s", path, " (best)" if is_best else "")

    def _diverged(self, why: str) -> int:
        """The one line of a diverged run (trainer.nonfinite); nothing more is saved."""
        files = self.checkpointer.step_files() if self.checkpointer is not None else []
        rank_zero(log.error)(diverged_line(why, self.step, self.scheduler.lr(), str(files[0][1]) if files else None))
        return exit_codes.DIVERGED

    def close(self, code: int = 0) -> None:
        """`code`: how the run ended (transformer/exit_codes.py), for the experiment trackers."""
        self.metrics.close(code)
        self.data.close()
