#!/usr/bin/env bash
# CI's Slurm tier: a real one-node Slurm cluster on this machine, and the `slurm` tests run
# against it (real sbatch, srun, scancel, scontrol). As root it:
#   1. installs slurm-wlm and munge with apt-get when missing (.debs cached in TIER_CACHE);
#   2. installs the project's `slurm` extra (hydra-submitit-launcher) into TIER_PYTHON's environment;
#   3. writes a slurm.conf for this host: one node "localhost" at 127.0.0.1 with the CPUs and memory
#      `slurmd -C` reports, one partition, backfill scheduling, requeue allowed; state, spool, logs
#      and the munge key and socket in a temp dir, ports picked free on 127.0.0.1;
#   4. starts munged, slurmctld and slurmd as its own processes and waits for the node to be idle;
#   5. runs `pytest -m slurm` with SLURM_CONF pointing at that cluster;
#   6. on every exit path: cancels the jobs left, stops the three daemons by PID, ends the job
#      processes still working in its temp dir, removes the temp dir (TIER_KEEP=1 keeps it).
# Usage: launch/ci/run-slurm-tier.sh [-h] [PYTEST_ARGS ...]   (e.g. -k sbatch -x)
# Environment: TIER_CACHE (default /var/cache/transformer-ci), TIER_PYTHON (default: the
#   repository's .venv/bin/python, else python3), TIER_KEEP=1 keeps the temp dir and its logs.
# Exit 0 on success, 77 when it cannot run here (not root, no apt-get), else the failing status.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TIER=slurm-tier
# shellcheck source=launch/ci/tier-lib.sh
source "$REPO/launch/ci/tier-lib.sh"

case "${1:-}" in
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
esac

need_root_and_apt "slurmctld, slurmd, munged"
if [[ -n "${TIER_PYTHON:-}" ]]; then py=$TIER_PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then py=$REPO/.venv/bin/python
else py=python3; fi

TMP=""
MUNGED_PID=""
SLURMCTLD_PID=""
SLURMD_PID=""
PYTEST_PID=""

# Processes whose working directory or an open file lies in $TMP: the jobs our slurmd started
# (the tests submit from folders under $TMP) and their slurmstepd. Never anything else.
tier_processes() {
    local d pid
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        ((pid == $$)) && continue
        if [[ "$(readlink "$d/cwd" 2>/dev/null)" == "$TMP"* ]] ||
            find "$d/fd" -maxdepth 1 -lname "$TMP*" -print -quit 2>/dev/null | grep -q .; then
            echo "$pid"
        fi
    done
}

cleanup() {
    local rc=$?
    set +e
    begin_cleanup
    stop_pid "$PYTEST_PID" pytest  # first, so that nothing submits jobs any more
    if [[ -n "$SLURMCTLD_PID" ]] && kill -0 "$SLURMCTLD_PID" 2>/dev/null; then
        local left
        left=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
        if [[ -n "${left// /}" ]]; then
            log "cancelling jobs left: $left"
            # shellcheck disable=SC2086  # a list of job ids
            scancel $left 2>/dev/null
            for _ in $(seq 1 150); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.2; done
        fi
    fi
    stop_pid "$SLURMD_PID" slurmd
    stop_pid "$SLURMCTLD_PID" slurmctld
    stop_pid "$MUNGED_PID" munged
    if [[ -n "$TMP" && -d "$TMP" ]]; then
        local stray
        stray=$(tier_processes | tr '\n' ' ')
        if [[ -n "${stray// /}" ]]; then
            log "ending job processes still in $TMP: $stray"
            # shellcheck disable=SC2086  # a list of pids
            kill -9 $stray 2>/dev/null
        fi
        if [[ "${TIER_KEEP:-0}" == 1 ]]; then log "kept $TMP"; else rm -rf "$TMP"; log "removed $TMP"; fi
    fi
    finish_tier "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TMP=$(mktemp -d /tmp/transformer-slurm.XXXXXX)
# munged wants every folder above its socket searchable by all.
chmod 711 "$TMP"
mkdir -p "$CACHE"

# --- 1. packages ------------------------------------------------------------------------------
begin "apt: slurm-wlm munge"
missing=0
for exe in slurmctld slurmd munged sbatch srun scontrol scancel squeue sinfo; do
    command -v "$exe" >/dev/null 2>&1 || missing=1
done
if ((missing == 1)); then apt_install "$TMP/apt.log" slurm-wlm munge; fi
log "$(slurmctld -V), $(munged -V 2>&1 | head -n 1)"
end

# --- 2. hydra-submitit-launcher ---------------------------------------------------------------
begin "pip: slurm extra"
if ! "$py" -c "import hydra_plugins.hydra_submitit_launcher, transformer" 2>/dev/null; then
    log "$py -m pip install -e '.[slurm]'"
    "$py" -m pip install -q -c "$REPO/constraints-cpu.txt" -e "${REPO}[slurm]" >"$TMP/pip.log" 2>&1 ||
        { tail -20 "$TMP/pip.log"; fail "pip install -e '.[slurm]' with $py"; }
fi
log "hydra-submitit-launcher $("$py" -c 'import importlib.metadata as m; print(m.version("hydra-submitit-launcher"))')"
end

# --- 3. configuration -------------------------------------------------------------------------
begin "slurm.conf"
free_ports() {  # $1 ports the kernel hands out on 127.0.0.1, all open at once so they differ
    "$py" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}
read -r ctld_port slurmd_port <<<"$(free_ports 2)"
# This machine as slurmd sees it: CPUs=... Boards=... SocketsPerBoard=... RealMemory=...
hw=$(slurmd -C | head -n 1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')
[[ "$hw" == *CPUs=* && "$hw" == *RealMemory=* ]] || fail "slurmd -C printed no CPUs/RealMemory: $(slurmd -C)"
mkdir -p "$TMP"/{etc,state,spool,log,munge}
chmod 711 "$TMP/munge"
head -c 1024 /dev/urandom >"$TMP/munge/munge.key"
chmod 600 "$TMP/munge/munge.key"
export SLURM_CONF=$TMP/etc/slurm.conf
cat >"$SLURM_CONF" <<EOF
# Written by launch/ci/run-slurm-tier.sh: one node (this machine, as localhost), one partition.
ClusterName=transformer-ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$TMP/munge/munge.sock,cred_expire=10
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd.log
MailProg=/bin/true
# No cgroups: processes tracked through /proc, no task binding (containers rarely allow more).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60 s and 30 s): a requeued job restarts as soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Jobs may be requeued (sbatch --requeue, scontrol requeue); finished jobs stay visible to
# scontrol show job (JobState, ExitCode, Restarts = the requeue count) for 10 minutes.
JobRequeue=1
MinJobAge=600
# Seconds between the TERM and the KILL of a cancelled or requeued job: time to checkpoint.
KillWait=60
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost NodeAddr=127.0.0.1 ${hw}State=UNKNOWN
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
log "node localhost: $hw; slurmctld on 127.0.0.1:$ctld_port, slurmd on 127.0.0.1:$slurmd_port"
end

# --- 4. daemons -------------------------------------------------------------------------------
begin "start munged slurmctld slurmd"
munged --foreground --force --socket="$TMP/munge/munge.sock" --key-file="$TMP/munge/munge.key" \
    --pid-file="$TMP/munge/munged.pid" --seed-file="$TMP/munge/munged.seed" \
    --log-file="$TMP/log/munged.log" >"$TMP/log/munged.out" 2>&1 &
MUNGED_PID=$!
for _ in $(seq 1 50); do [[ -S "$TMP/munge/munge.sock" ]] && break; sleep 0.1; done
[[ -S "$TMP/munge/munge.sock" ]] || { cat "$TMP/log/munged.out"; fail "munged did not start"; }
# -D: in the foreground, so $! is the daemon itself; -i: ignore state files (there are none).
slurmctld -D -i -f "$SLURM_CONF" >"$TMP/log/slurmctld.out" 2>&1 &
SLURMCTLD_PID=$!
slurmd -D -N localhost -f "$SLURM_CONF" >"$TMP/log/slurmd.out" 2>&1 &
SLURMD_PID=$!
state=""
for _ in $(seq 1 150); do
    kill -0 "$SLURMCTLD_PID" 2>/dev/null || { tail -20 "$TMP/log/slurmctld.out"; fail "slurmctld exited"; }
    kill -0 "$SLURMD_PID" 2>/dev/null || { tail -20 "$TMP/log/slurmd.out"; fail "slurmd exited"; }
    state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
    [[ "$state" == idle ]] && break
    sleep 0.2
done
[[ "$state" == idle ]] ||
    { tail -10 "$TMP/log/slurmctld.out" "$TMP/log/slurmd.out"; fail "node not idle after 30 s (state '$state')"; }
log "munged $MUNGED_PID, slurmctld $SLURMCTLD_PID, slurmd $SLURMD_PID; $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %T')"
end

# --- 5. tests ---------------------------------------------------------------------------------
begin "pytest -m slurm"
# The tests' folders (submit dirs, run dirs) under $TMP: what cleanup looks for.
# In the background: a TERM or INT to this script then ends the wait at once and cleanup runs.
(cd "$REPO" && exec "$py" -m pytest -m slurm -p no:cacheprovider --durations=0 --basetemp="$TMP/pytest" "$@") &
PYTEST_PID=$!
rc=0
wait "$PYTEST_PID" || rc=$?
PYTEST_PID=""
if ((rc != 0)); then
    for f in slurmctld slurmd; do echo "--- last lines of $f.log"; tail -15 "$TMP/log/$f.log" 2>/dev/null; done
    fail "pytest -m slurm exited $rc"
fi
end
