# shellcheck shell=bash
# Helpers shared by the launch scripts. Sourced, never run.

# One line naming what is wrong, then exit 2 (a usage error, not a training failure).
die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

# Is $1 a whole number >= 1?
is_count() {
    [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

# Number of GPUs this process may use: CUDA_VISIBLE_DEVICES first (Slurm and docker --gpus set it,
# and it is what torch will see), then nvidia-smi, else 1 (one CPU worker).
gpu_count() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" ]]; then
            echo 1
        else
            local ids
            IFS=',' read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
            echo "${#ids[@]}"
        fi
        return
    fi
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        # Only "GPU i: ..." lines; MIG instances are listed indented below their GPU.
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    fi
    if is_count "$n"; then echo "$n"; else echo 1; fi
}

# Environment every launch needs. $1 = workers on this node.
export_launch_env() {
    local nproc=$1
    # A fresh TCPStore for every rendezvous round, so gloo/NCCL groups rejoin cleanly after an
    # elastic restart instead of reusing keys left by the failed attempt.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # torchrun forwards these to the workers (torch >= 2.8 reads the list; older ones ignore it and
    # handle TERM/INT/HUP/QUIT only). The trainer checkpoints and exits 3 on TERM and USR1.
    export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
    # Seconds torchrun waits for workers to finish their checkpoint before SIGKILL (default 30).
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-90}"
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
        local cores
        cores=${SLURM_CPUS_ON_NODE:-$(nproc 2>/dev/null || echo 1)}
        is_count "$cores" || cores=1
        local threads=$((cores / nproc))
        ((threads >= 1)) || threads=1
        export OMP_NUM_THREADS=$threads
    fi
}

# The Python that runs torchrun: $PYTHON, else python3 on PATH. It runs it as transformer.cli.torchrun, which
# ends a run stopped on purpose (Ctrl-C, SIGTERM, SIGUSR1) with the workers' exit code and restarts no worker
# that exited so. Fails with one clear line when it is missing or cannot import the project.
find_python() {
    local want=${PYTHON:-python3}
    local hint="activate the environment where the project is installed (pip install -e .), or set PYTHON=/path/to/python"
    command -v "$want" >/dev/null 2>&1 || die "'$want' not found: $hint"
    "$want" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("transformer.cli.torchrun") is None)' \
        >/dev/null 2>&1 || die "'$want' cannot import the project (transformer.cli.torchrun): $hint"
    command -v "$want"
}

# Runs "$@" in place of this shell (signals then reach torchrun directly), or with DRY_RUN=1 prints
# the environment it sets and the command, shell-quoted, and exits 0.
run_or_print() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        local v
        for v in TORCH_DISABLE_SHARE_RDZV_TCP_STORE OMP_NUM_THREADS PET_SIGNALS_TO_HANDLE \
            TORCH_ELASTIC_SHUTDOWN_TIMEOUT; do
            printf '%s=%q ' "$v" "${!v}"
        done
        printf '%q ' "$@"
        printf '\n'
        exit 0
    fi
    exec "$@"
}
