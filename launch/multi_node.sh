#!/usr/bin/env bash
# Run this once on every node: torchrun with a c10d rendezvous, so no node needs a rank and a
# failed worker group restarts (up to --max-restarts) and resumes from the last checkpoint.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: launch/multi_node.sh [OPTIONS] [--] [HYDRA_OVERRIDE ...]

Run the same command on every node. Each node starts one torchrun agent, which rendezvouses with
the others at HOST:PORT (c10d backend; the node whose hostname is HOST hosts the store) and starts
one worker per GPU. Node ranks are assigned by the rendezvous. torchrun runs as
python3 -m transformer.cli.torchrun: a run stopped by Ctrl-C, SIGTERM or SIGUSR1 ends with the
workers' exit code 3, no traceback, and workers that exit so are never restarted.

Options (each also read from the environment variable in brackets):
  --nnodes N|MIN:MAX      nodes in the job [NNODES; under Slurm: SLURM_NNODES]
  --rdzv-endpoint H:P     rendezvous host and port [RDZV_ENDPOINT; under Slurm: first host of
                          SLURM_JOB_NODELIST (scontrol show hostnames) and RDZV_PORT]
  --rdzv-id ID            job id, the same on every node; names the run directory
                          outputs/torchrun-ID [RDZV_ID; under Slurm: SLURM_JOB_ID]
  --nproc-per-node N      workers per node [NPROC; default: GPUs visible, else 1]
  --max-restarts N        restarts of the worker group after a failure [MAX_RESTARTS; default 3]
  --local-addr ADDR       this node's address as the others reach it (default: torchrun's choice,
                          the host name); e.g. the address of the fast network [LOCAL_ADDR]
  -h, --help              this text

Environment:
  RDZV_PORT        port when the host comes from Slurm (default 20000 + SLURM_JOB_ID % 20000)
  RDZV_CONF        extra rendezvous settings, e.g. join_timeout=900
  PYTHON           Python to run torchrun with (default: python3 on PATH)
  OMP_NUM_THREADS  CPU threads per worker (default: cores / workers)
  DRY_RUN=1        print the command instead of running it

Examples:
  # on each of 2 nodes (node01 hosts the rendezvous):
  launch/multi_node.sh --nnodes 2 --rdzv-endpoint node01:29500 --rdzv-id wmt1 model=big
  # inside a Slurm allocation (one task per node): everything comes from Slurm
  srun --ntasks-per-node=1 launch/multi_node.sh model=big hydra.run.dir=outputs/slurm-$SLURM_JOB_ID
EOF
}

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

nnodes=${NNODES:-}
endpoint=${RDZV_ENDPOINT:-}
rdzv_id=${RDZV_ID:-}
nproc=${NPROC:-}
max_restarts=${MAX_RESTARTS:-3}
local_addr=${LOCAL_ADDR:-}

# Our options come first; the first word that is not one of them (an override, or a Hydra flag
# such as --cfg job) starts the trainer's arguments.
while (($# > 0)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        --nnodes=* | --rdzv-endpoint=* | --rdzv-id=* | --nproc-per-node=* | --max-restarts=* | --local-addr=*)
            opt=${1%%=*}; val=${1#*=}; shift
            set -- "$opt" "$val" "$@"
            ;;
        --nnodes | --rdzv-endpoint | --rdzv-id | --nproc-per-node | --max-restarts | --local-addr)
            (($# >= 2)) || die "$1 needs a value"
            case "$1" in
                --nnodes) nnodes=$2 ;;
                --rdzv-endpoint) endpoint=$2 ;;
                --rdzv-id) rdzv_id=$2 ;;
                --nproc-per-node) nproc=$2 ;;
                --max-restarts) max_restarts=$2 ;;
                --local-addr) local_addr=$2 ;;
            esac
            shift 2
            ;;
        *) break ;;
    esac
done

# Fill what is still missing from Slurm's environment.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    nnodes=${nnodes:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}}
    rdzv_id=${rdzv_id:-$SLURM_JOB_ID}
    if [[ -z "$endpoint" ]]; then
        nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
        [[ -n "$nodelist" ]] || die "SLURM_JOB_NODELIST is empty: pass --rdzv-endpoint HOST:PORT"
        command -v scontrol >/dev/null 2>&1 ||
            die "scontrol not found (needed to expand SLURM_JOB_NODELIST): pass --rdzv-endpoint HOST:PORT"
        # All of it, then the first line: `| head -n 1` could kill scontrol with SIGPIPE (pipefail).
        hosts=$(scontrol show hostnames "$nodelist") || die "'scontrol show hostnames $nodelist' failed"
        host=${hosts%%$'\n'*}
        [[ -n "$host" ]] || die "'scontrol show hostnames $nodelist' printed no host"
        [[ "$SLURM_JOB_ID" =~ ^[0-9]+$ ]] || die "SLURM_JOB_ID is not a number: '$SLURM_JOB_ID'"
        # A port derived from the job id: two jobs sharing a node do not collide.
        endpoint="$host:${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
    fi
fi
nproc=${nproc:-$(gpu_count)}

[[ -n "$nnodes" ]] || die "number of nodes unknown: pass --nnodes N (or set NNODES, or run under Slurm)"
[[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "--nnodes must be N or MIN:MAX, got '$nnodes'"
[[ -n "$endpoint" ]] || die "no rendezvous endpoint: pass --rdzv-endpoint HOST:PORT (or set RDZV_ENDPOINT, or run under Slurm)"
[[ "$endpoint" =~ ^[^:]+:[0-9]+$ ]] || die "--rdzv-endpoint must be HOST:PORT, got '$endpoint'"
is_count "$nproc" || die "--nproc-per-node must be a whole number >= 1, got '$nproc'"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max-restarts must be a whole number >= 0, got '$max_restarts'"
# The id names the run directory (outputs/torchrun-ID): a fixed default would make every new job resume the last.
[[ -n "$rdzv_id" ]] || die "no rendezvous id: pass --rdzv-id ID, the same on every node (it names the run directory outputs/torchrun-ID; reuse it to resume a run), or set RDZV_ID, or run under Slurm"

if [[ "${DRY_RUN:-0}" == "1" ]]; then python=${PYTHON:-python3}; else python=$(find_python); fi
export_launch_env "$nproc"

cmd=("$python" -m transformer.cli.torchrun --nnodes="$nnodes" --nproc-per-node="$nproc" --rdzv-backend=c10d
    --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id" --max-restarts="$max_restarts")
if [[ -n "${RDZV_CONF:-}" ]]; then cmd+=(--rdzv-conf="$RDZV_CONF"); fi
if [[ -n "$local_addr" ]]; then cmd+=(--local-addr="$local_addr"); fi
run_or_print "${cmd[@]}" -m transformer.train "$@"
