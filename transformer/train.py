"""`python -m transformer.train`: the module path that torchrun, Slurm scripts and users' own launchers name
(`torchrun ... -m transformer.train`); the program itself is transformer/cli/train.py."""
from transformer.cli.train import main

if __name__ == "__main__":
    main()
