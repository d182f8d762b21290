"""`transformer-bench`: training speed of any training config, as one table and one JSON line.

    transformer-bench experiment=multi30k model=small                 # real Multi30k batches, CPU or GPU
    transformer-bench model=big trainer.precision=bf16 data.max_tokens=16000 bench.synthetic=true
    torchrun --nproc-per-node=8 -m transformer.cli.bench model=base bench.synthetic=true

The same config groups as transformer-train, plus `bench.*` (transformer/config.py: BenchConfig). It
writes no files unless asked: `bench.out=FILE` appends the JSON line to FILE. Bad input: one `error:` line,
exit code 2.
"""
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from transformer import exit_codes
from transformer.cli.compose import precheck
from transformer.config import CONF_DIR, register_configs
from transformer.config_checks import validate
from transformer.training.launcher import USER_INPUT_ERRORS


def bench(cfg: DictConfig) -> None:
    from transformer.training.tools.bench import run_benchmark

    try:
        run_benchmark(cfg)
    except USER_INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(exit_codes.USER_ERROR)


def main() -> None:
    register_configs()
    OmegaConf.register_new_resolver("run_name", lambda: "bench", replace=True)
    # Hydra's run directory is the working directory (it exists, so nothing is created) unless one is given.
    if not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=.")
    code = precheck(sys.argv[1:], validate)  # composition errors: one line, exit 2
    if code:
        sys.exit(code)
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(bench)()


if __name__ == "__main__":
    main()
