"""What a run's checkpoint files are called and hold, for every layer that names them: the trainer writes them
(transformer/training/components/checkpoint.py), the machine-error line names the newest (transformer/environment.py),
the Hugging Face importer makes checkpoint-shaped dicts and raises CheckpointError's kind
(transformer/interop/). No project imports: it sits at the bottom, so none of them imports a layer above it."""
import re
from pathlib import Path
from typing import List, Tuple

FORMAT = "transformer-checkpoint/1"  # a checkpoint's "format": what load_checkpoint accepts
FOLDER = "checkpoints"  # under the run directory
STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint (or a model folder read as one) this run cannot use: the message is the one line to print."""


def step_files(folder: Path) -> List[Tuple[int, Path]]:
    """(step, path) of the step checkpoints in `folder`, newest first; [] when there is no folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)
