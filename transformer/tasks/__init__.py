"""Tasks: per dataset, the metrics it declares, its validation scoring and its final evaluation."""
from transformer.tasks.base import VAL_LOSS, Metric, Task
from transformer.tasks.copy import CopyTask
from transformer.tasks.translation import TranslationTask

__all__ = ["VAL_LOSS", "CopyTask", "Metric", "Task", "TranslationTask", "build_task"]


def build_task(cfg) -> Task:
    """The task of `cfg.data.name`: the synthetic copy task, or translation for every parallel corpus."""
    return CopyTask(cfg) if cfg.data.name == "copy" else TranslationTask(cfg)
