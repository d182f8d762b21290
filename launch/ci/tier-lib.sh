# shellcheck shell=bash
# Helpers shared by the CI tiers that start their own daemons (docker/ci/run-docker-tier.sh,
# launch/ci/run-slurm-tier.sh). Sourced, never run. The caller sets TIER (the log prefix) first.

CACHE=${TIER_CACHE:-/var/cache/transformer-ci}

log() { echo "[$TIER $(date +%H:%M:%S)] $*"; }
fail() { echo "[$TIER] FAILED: $*" >&2; exit 1; }

# Exit 77 (skip) where a tier cannot run: it needs root for apt-get and for its daemons.
need_root_and_apt() {
    if [[ $(id -u) -ne 0 ]]; then echo "[$TIER] SKIP: needs root (apt-get, $1)"; exit 77; fi
    if ! command -v apt-get >/dev/null 2>&1; then echo "[$TIER] SKIP: no apt-get on this machine"; exit 77; fi
}

# Phase timings, printed at the end (and on failure): begin NAME ... end; report at exit.
declare -a PHASES=()
phase_name=""
phase_start=0
phase_open=0
tier_t0=$(date +%s.%N)
begin() { phase_name=$1; phase_start=$(date +%s.%N); phase_open=1; log "== $1"; }
end() {
    phase_open=0
    local secs
    secs=$(awk -v a="$phase_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    PHASES+=("$(printf '%-28s %7ss' "$phase_name" "$secs")")
    log "   $phase_name: ${secs}s"
}
report() {
    echo "[$TIER] phase timings:"
    local p
    for p in "${PHASES[@]}"; do echo "  $p"; done
    awk -v a="$tier_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "  %-28s %7.1fs\n", "total", b - a }'
}
# First thing in an EXIT trap: closes a phase cut short by the failure and opens "cleanup".
begin_cleanup() {
    if ((phase_open == 1)); then phase_name="$phase_name (failed)"; end; fi
    ((${#PHASES[@]} == 0)) || begin "cleanup"
}
# Last thing in an EXIT trap: timings and the verdict, then exit with $1.
finish_tier() {
    ((${#PHASES[@]} == 0)) || { end; report; }
    if (($1 == 0)); then echo "[$TIER] OK"; else echo "[$TIER] FAILED (exit $1)"; fi
    exit "$1"
}

# Stops a daemon this script started: TERM, up to $3 seconds (default 20) to exit, then KILL.
stop_pid() {
    local pid=$1 name=$2 secs=${3:-20}
    [[ -n "$pid" ]] || return 0
    kill "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
    local i
    for ((i = 0; i < secs * 5; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; log "$name did not stop in ${secs}s: killed"; fi
    wait "$pid" 2>/dev/null
    log "$name stopped"
}

# apt-get install of the Debian packages named, with the .debs kept under $CACHE/debs (a second
# install on this machine downloads nothing). Services the packages would start are not started
# (policy-rc.d, when the machine has none): the tiers run their own daemons.
apt_install() {
    local logfile=$1
    shift
    log "installing $*"
    mkdir -p "$CACHE/debs/partial"
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\n# %s: no services started while it installs packages\nexit 101\n' "$TIER" >"$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    local rc=0
    {
        apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                -o Dir::Cache::archives="$CACHE/debs" "$@"
    } >"$logfile" 2>&1 || rc=$?
    if ((made_policy == 1)); then rm -f "$policy"; fi
    if ((rc != 0)); then tail -20 "$logfile"; fail "apt-get install $*"; fi
}
