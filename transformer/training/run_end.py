"""The end of a run, a part of the Trainer: the average of the last checkpoints (scored on validation; best.pt
if it wins), the task's final scores with best.pt's weights, the figures and the one-line summary.
Collective where marked: every rank calls them, rank 0 alone writes."""
import logging
from pathlib import Path
from typing import Optional

from transformer.config import to_container
from transformer.dist import rank_zero
from transformer.training.checkpoint import atomic_link, atomic_save, load_checkpoint, model_weights

log = logging.getLogger(__name__)


class RunEnd:
    """Mixed into Trainer; uses its cfg, env, model, data, task, run_dir, checkpointer, metrics, metric, best,
    clock, quality, step, epoch and validator."""

    def average_last(self) -> None:
        """checkpoint.average_last=K: the average of the last K checkpoints (as `transformer-average RUN --last
        K` writes it) is saved as checkpoints/average_lastK.pt and scored on validation; if it beats the best
        checkpoint on checkpoint.best_metric, best.pt becomes it. Collective."""
        K = self.cfg.checkpoint.average_last
        if K < 2:
            return
        path = self.env.broadcast_object(self._write_average(K))
        if path is None:
            return
        self.model.load_state_dict(load_checkpoint(path)["model"])
        values = self.validator.scores(self.model, self.ema)
        self.metrics.log("average", self.step, self.epoch, **values, checkpoints=K)
        if self.validator.better(values[self.metric.name]):
            self.validator.best = values[self.metric.name]
            self._link_best(path)

    @rank_zero
    def _write_average(self, K: int) -> Optional[str]:
        if self.checkpointer is None or len(self.checkpointer.step_files()) < K:
            log.warning("checkpoint.average_last=%d: fewer checkpoints than that were kept; nothing averaged", K)
            return None
        from transformer.training.averaging import average_checkpoints, last_checkpoints

        out = self.checkpointer.folder / f"average_last{K}.pt"
        atomic_save(average_checkpoints(last_checkpoints(self.run_dir, K)), out)
        return str(out)

    @rank_zero
    def _link_best(self, path: str) -> None:
        atomic_link(Path(path), self.checkpointer.folder / "best.pt")
        log.info("best.pt is now %s (better %s than every single checkpoint)", path, self.metric.name)

    def final_eval(self) -> None:
        """The task's final scores (the copy task: accuracy on fresh sequences), with the weights of best.pt,
        chosen on the validation split as for any model selection; then the figures."""
        self.average_last()
        best = self.checkpointer.folder / "best.pt" if self.checkpointer is not None else None
        path = self.env.broadcast_object(str(best) if best is not None and best.is_file() else None)
        if path is not None:
            ckpt = load_checkpoint(path)
            self.model.load_state_dict(model_weights(ckpt))
            self.tune_decoding(path, ckpt)
        values = self.task.test(self.model, self.data, self.env)
        if values:
            self.metrics.log("test", self.step, self.epoch, **values, checkpoint="best" if path else "last")
        self._log_figures()
        self._summary(path)

    def tune_decoding(self, best: str, ckpt: dict) -> None:
        """eval.tune_lenpen: the task scores best.pt's weights (`ckpt`, loaded) on validation at each length
        penalty; the choice goes into best.pt as ckpt["decoding"], which transformer-evaluate/translate apply
        over the saved eval config. Collective."""
        tuned = self.task.tune(self.model, self.data, self.env)
        if tuned is not None:
            self.metrics.log("tune", self.step, self.epoch, **tuned)
            self._store_decoding(Path(best), ckpt, tuned)

    @rank_zero
    def _store_decoding(self, best: Path, ckpt: dict, tuned: dict) -> None:
        # best.pt is a hard link: rewrite the file it shares, then point every link to it at the new file.
        target = self.checkpointer.target(best)
        links = [p for p in (best, self.checkpointer.folder / "last.pt")
                 if p != target and p.exists() and p.samefile(target)]
        ckpt["decoding"] = {"lenpen": tuned["lenpen"], "chosen_on": "validation BLEU",
                            "val_bleu": {k: v for k, v in tuned.items() if k != "lenpen"}}
        atomic_save(ckpt, target)
        for link in links:
            atomic_link(target, link)
        log.info("lenpen %g chosen on validation (eval.tune_lenpen), stored in %s", tuned["lenpen"], target)

    @rank_zero
    def _summary(self, best: Optional[str]) -> None:
        chosen = self.checkpointer.target(Path(best)) if best else "no checkpoint"  # best.pt links to it
        log.info("done: step %d, epoch %d, %.1f min | best %s=%s: %s (chosen by checkpoint.best_metric on the "
                 "validation split) | time to quality: %s", self.step, self.epoch, self.clock.seconds() / 60,
                 self.metric.name, f"{self.validator.best:.4g}" if self.validator.best is not None else "n/a", chosen,
                 self.quality.summary())

    @rank_zero
    def _log_figures(self) -> None:
        """Loss/score/rate curves and the attention maps of a validation sentence, as TensorBoard images
        (`transformer-plot RUN_DIR` draws the same as PNG files)."""
        if self.metrics.writer is None:
            return
        from transformer.training.plots import log_figures

        log_figures(self.metrics.writer, run_dir=self.run_dir, cfg=to_container(self.cfg), model=self.model,
                    tokenizer=self.data.tokenizer, sentence=self.task.sample_sentence(self.data), step=self.step,
                    ev=self.cfg.eval)
