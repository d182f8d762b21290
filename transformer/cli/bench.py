"""`transformer-bench`: training speed of any training config, as one table and one JSON line.

    transformer-bench experiment=multi30k model=small                 # real Multi30k batches, CPU or GPU
    transformer-bench model=big trainer.precision=bf16 data.max_tokens=16000 bench.synthetic=true
    torchrun --nproc-per-node=8 -m transformer.cli.bench model=base bench.synthetic=true

The same config groups as transformer-train, plus `bench.*` (transformer/config.py: BenchConfig). It
writes no files unless asked: `bench.out=FILE` appends the JSON line to FILE. Bad input: one `error:` line,
exit code 2.
"""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from transformer.config import register_configs
from transformer.data.download import DownloadError
from transformer.training.checkpoint import CheckpointError

BAD_INPUT = (ValueError, CheckpointError, FileNotFoundError, DownloadError)  # ConfigError is a ValueError
CONF = str(Path(__file__).resolve().parents[2] / "conf")  # absolute: a relative path would name a package


def bench(cfg: DictConfig) -> None:
    from transformer.training.bench import run_benchmark

    try:
        run_benchmark(cfg)
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    register_configs()
    OmegaConf.register_new_resolver("run_name", lambda: "bench", replace=True)
    # Hydra's run directory is the working directory (it exists, so nothing is created) unless one is given.
    if not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=.")
    hydra.main(config_path=CONF, config_name="config", version_base="1.3")(bench)()


if __name__ == "__main__":
    main()
