#!/usr/bin/env bash
# Train on every GPU of this machine: one torchrun worker per GPU, rendezvous on localhost.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: launch/single_node.sh [--] [HYDRA_OVERRIDE ...]

Trains on one machine with one worker per GPU, through torchrun:
  python3 -m transformer.cli.torchrun --standalone --nproc-per-node=$NPROC -m transformer.train HYDRA_OVERRIDE ...
(transformer.cli.torchrun is torchrun, but a run stopped by Ctrl-C, SIGTERM or SIGUSR1 ends with the
workers' exit code 3, no traceback, and workers that exit so are never restarted).

Environment:
  NPROC            workers (default: GPUs in CUDA_VISIBLE_DEVICES, else nvidia-smi, else 1)
  MAX_RESTARTS     elastic restarts after a worker failure (default 0)
  PYTHON           Python to run it with (default: python3 on PATH)
  OMP_NUM_THREADS  CPU threads per worker (default: cores / workers)
  DRY_RUN=1        print the command instead of running it

Put `--` first to pass -h/--help on to the trainer (Hydra's help).

Examples:
  launch/single_node.sh experiment=copy trainer.max_steps=200
  NPROC=2 launch/single_node.sh model=base data=multi30k
EOF
}

case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    --) shift ;;
esac

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

nproc=${NPROC:-$(gpu_count)}
is_count "$nproc" || die "NPROC must be a whole number >= 1, got '$nproc'"
max_restarts=${MAX_RESTARTS:-0}
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a whole number >= 0, got '$max_restarts'"

if [[ "${DRY_RUN:-0}" == "1" ]]; then python=${PYTHON:-python3}; else python=$(find_python); fi
export_launch_env "$nproc"

run_or_print "$python" -m transformer.cli.torchrun --standalone --nnodes=1 --nproc-per-node="$nproc" \
    --max-restarts="$max_restarts" -m transformer.train "$@"
