#!/usr/bin/env bash
# CI's Docker tier: builds docker/Dockerfile and trains in the container, on a machine that has no
# container registry, only Debian's and PyPI's package registries. As root it:
#   1. installs docker.io and debootstrap with apt-get when missing;
#   2. starts a private dockerd (no bridge, no iptables; stopped on exit) whose images and build cache
#      are kept in TIER_CACHE/docker (one tier at a time: a lock), so an unchanged torch layer is reused;
#   3. imports a Debian bookworm base image made with debootstrap (tarball cached);
#   4. builds a wheelhouse of the project's dependencies on the host, with constraints-cpu.txt (cached),
#      and serves it to the build on 127.0.0.1;
#   5. docker build --network host of docker/Dockerfile on that base, offline (--no-index): its first
#      stage builds the project's wheel, its second installs it (not an editable tree);
#   6. docker run --network host: non-root user, the installed wheel (not a source tree) and its
#      `transformer-train --version` (this clone's commit), then a short training run whose exit code and
#      checkpoint are checked;
#   7. two containers as two nodes (host network, 127.0.0.1 only): multi_node.sh --nnodes 2 in each,
#      1 CPU worker per node, one outputs folder mounted in both; every file must come from the
#      container of global rank 0. Then the same job with --max-restarts 1, `docker kill` of the second
#      container after the first checkpoint and `docker start` of it: the job must finish with final
#      weights bit-identical to the uninterrupted two-node run.
# Usage: docker/ci/run-docker-tier.sh [-h] [--mirror]
#   --mirror  only print the Debian mirror read from the apt sources, and exit
# Environment: TIER_CACHE (default /var/cache/transformer-ci), TIER_MIRROR, TIER_PYTHON (python3),
#   TIER_TRAIN_ARGS (default "experiment=copy trainer.max_steps=20 checkpoint.every_steps=10
#   trainer.progress=false" and a tiny model), TIER_NODES_ARGS (the two-node job's overrides, a tiny model),
#   TIER_DOCKER_DATA (dockerd's data root, default TIER_CACHE/docker; delete it to start afresh),
#   APT_ETC (default /etc/apt), TIER_KEEP=1 keeps the temp dir.
# Exit 0 on success, 77 when it cannot run here (not root, no apt-get), else the failing status.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TIER=docker-tier
# shellcheck source=launch/ci/tier-lib.sh
source "$REPO/launch/ci/tier-lib.sh"
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python3-pip
DATA_ROOT=${TIER_DOCKER_DATA:-$CACHE/docker}
IMAGE=transformer-ci
TRAIN_ARGS=${TIER_TRAIN_ARGS:-experiment=copy trainer.max_steps=20 checkpoint.every_steps=10 trainer.progress=false model.N=1 model.d_model=32 model.d_ff=64 model.h=2 data.copy.train_size=640}
# The two-node jobs: a tiny copy model, dropout on (so the RNG state must resume exactly), a checkpoint
# every 10 of 150 steps, gloo on CPU.
NODES_ARGS=${TIER_NODES_ARGS:-experiment=copy data.copy.train_size=6400 data.copy.val_size=48 data.copy.test_size=16 model.N=1 model.d_model=32 model.d_ff=64 model.h=2 model.dropout=0.1 trainer.max_epochs=null trainer.max_steps=150 trainer.val_every=1000 checkpoint.every_steps=10 trainer.log_every=50 trainer.progress=false trainer.accelerator=cpu}

# The Debian mirror this machine's apt uses for $SUITE: deb822 *.sources first, then one-line
# sources.list files; deb.debian.org when none names it.
apt_mirror() {
    local etc=${APT_ETC:-/etc/apt} f
    local files=()
    for f in "$etc"/sources.list.d/*.sources; do [[ -f "$f" ]] && files+=("$f"); done
    if ((${#files[@]} > 0)); then
        # Stanzas are separated by blank lines; take URIs of an enabled stanza whose Suites has $SUITE.
        local m
        m=$(awk -v suite="$SUITE" '
            function flush() { if (!done && uris != "" && ok && enabled) { split(uris, u, " "); print u[1]; done = 1; exit } uris = ""; ok = 0; enabled = 1 }
            BEGIN { enabled = 1 }
            /^[[:space:]]*#/ { next }
            /^[[:space:]]*$/ { flush(); next }
            tolower($1) == "uris:" { uris = ""; for (i = 2; i <= NF; i++) uris = uris " " $i }
            tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
            END { flush() }' "${files[@]}")
        if [[ -n "$m" ]]; then echo "${m%/}"; return; fi
    fi
    files=()
    for f in "$etc"/sources.list "$etc"/sources.list.d/*.list; do [[ -f "$f" ]] && files+=("$f"); done
    if ((${#files[@]} > 0)); then
        local m
        # deb [options] URI SUITE COMPONENTS...
        m=$(awk -v suite="$SUITE" '
            $1 == "deb" { i = 2; if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                          if ($(i + 1) == suite) { print $i; exit } }' "${files[@]}")
        if [[ -n "$m" ]]; then echo "${m%/}"; return; fi
    fi
    echo "http://deb.debian.org/debian"
}

case "${1:-}" in
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    --mirror) apt_mirror; exit 0 ;;
    "") ;;
    *) echo "run-docker-tier.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

need_root_and_apt dockerd

DOCKER=docker
TMP=""
DOCKERD_PID=""
SERVER_PID=""
cleanup() {
    local rc=$?
    set +e
    begin_cleanup
    if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
    # Containers a failed two-node phase left (running or exited): the data root is this tier's own and
    # outlives the run, and a container left there would hold its name against the next run.
    if [[ -n "$DOCKERD_PID" ]] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        local left
        left=$("$DOCKER" ps -aq 2>/dev/null | tr '\n' ' ')
        # shellcheck disable=SC2086  # a list of container ids
        if [[ -n "${left// /}" ]]; then "$DOCKER" rm -f $left >/dev/null 2>&1; log "removed containers $left"; fi
    fi
    stop_pid "$DOCKERD_PID" dockerd
    # Whatever a dockerd that did not stop cleanly left mounted (overlay layers, netns).
    if [[ -n "$DOCKERD_PID" ]]; then
        awk -v t="$DATA_ROOT/" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount -l
    fi
    if [[ -n "$TMP" && -d "$TMP" ]]; then
        awk -v t="$TMP" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount -l
        if [[ "${TIER_KEEP:-0}" == 1 ]]; then log "kept $TMP"; else rm -rf "$TMP"; log "removed $TMP"; fi
    fi
    finish_tier "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TMP=$(mktemp -d /tmp/transformer-docker.XXXXXX)
mkdir -p "$CACHE" "$DATA_ROOT"
# Two dockerds must never share a data root: a second tier waits for the first.
exec 9>"$DATA_ROOT.lock"
if ! flock -n 9; then
    log "waiting for the other Docker tier using $DATA_ROOT"
    flock -w 3600 9 || fail "$DATA_ROOT is still locked after an hour"
fi

# --- 1. packages ------------------------------------------------------------------------------
begin "apt: docker.io debootstrap"
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
if ((${#missing[@]} > 0)); then apt_install "$TMP/apt.log" "${missing[@]}"; fi
# The daemon is 20.10 from Debian; a newer docker client elsewhere on PATH negotiates down to it.
command -v docker >/dev/null 2>&1 || fail "no docker client after installing docker.io"
end

# --- 2. dockerd -------------------------------------------------------------------------------
begin "start dockerd"
export DOCKER_HOST="unix://$TMP/docker.sock"
# The classic builder: no buildx plugin is needed and --network host applies to RUN steps.
export DOCKER_BUILDKIT=0
dockerd --bridge=none --iptables=false --ip6tables=false --data-root="$DATA_ROOT" \
    --exec-root="$TMP/exec" --pidfile="$TMP/dockerd.pid" --host="$DOCKER_HOST" >"$TMP/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 1 150); do
    "$DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$TMP/dockerd.log"; fail "dockerd exited"; }
    sleep 0.2
done
"$DOCKER" info >/dev/null 2>&1 || { tail -20 "$TMP/dockerd.log"; fail "dockerd did not answer in 30 s"; }
log "dockerd $("$DOCKER" version --format '{{.Server.Version}}') storage $("$DOCKER" info --format '{{.Driver}}')"
end

# --- 3. base image ----------------------------------------------------------------------------
begin "base image (debootstrap)"
mirror=${TIER_MIRROR:-$(apt_mirror)}
base_key=$(printf '%s %s %s' "$SUITE" "$BASE_PACKAGES" "$(uname -m)" | sha256sum | cut -c1-12)
base_tar="$CACHE/base-$SUITE-$base_key.tar"
if [[ -s "$base_tar" ]]; then
    log "cached $base_tar"
else
    log "debootstrap --variant=minbase $SUITE from $mirror"
    rootfs="$TMP/rootfs"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$mirror" >"$TMP/debootstrap.log" 2>&1 ||
        { tail -30 "$TMP/debootstrap.log"; fail "debootstrap (log above)"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    # debootstrap may leave /proc or /sys mounted inside the rootfs.
    awk -v t="$rootfs" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount -l
    tar --numeric-owner -C "$rootfs" -cf "$base_tar.tmp" .
    mv "$base_tar.tmp" "$base_tar"
    rm -rf "$rootfs"
    find "$CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" ! -path "$base_tar" -delete
fi
# Tagged by the tarball's key: imported once, so the build cache on top of it stays valid.
BASE_IMAGE=transformer-ci-base:$base_key
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    "$DOCKER" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' "$base_tar" "$BASE_IMAGE" >/dev/null
fi
container_py=$("$DOCKER" run --rm --network host "$BASE_IMAGE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
log "base image $BASE_IMAGE: Python $container_py"
end

# --- 4. wheelhouse ----------------------------------------------------------------------------
begin "wheelhouse"
py=${TIER_PYTHON:-python3}
host_py=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$host_py" == "$container_py" ]] ||
    fail "host $py is Python $host_py but the image has $container_py: set TIER_PYTHON to a Python $container_py"
wh_key=$(cat "$REPO/setup.cfg" "$REPO/pyproject.toml" "$REPO/constraints-cpu.txt" | sha256sum | cut -c1-12)
wheels="$CACHE/wheels-py$host_py-$wh_key"
if [[ -f "$wheels/.complete" ]]; then
    log "cached $wheels ($(find "$wheels" -name '*.whl' | wc -l) wheels)"
else
    rm -rf "$wheels.tmp"
    # The project's wheel only drives the resolver; the image builds its own from the source.
    # setuptools and wheel are its build requirements (pyproject.toml), for the image's wheel stage.
    "$py" -m pip wheel -q --wheel-dir "$wheels.tmp" -c "$REPO/constraints-cpu.txt" "$REPO" \
        "setuptools>=64" wheel >"$TMP/wheel.log" 2>&1 || { tail -30 "$TMP/wheel.log"; fail "pip wheel"; }
    rm -f "$wheels.tmp"/transformer-*.whl
    rm -rf "$wheels"
    mv "$wheels.tmp" "$wheels"
    touch "$wheels/.complete"
    find "$CACHE" -maxdepth 1 -name 'wheels-*' ! -path "$wheels" -exec rm -rf {} +
fi
torch_wheel=$(find "$wheels" -name 'torch-*.whl' -printf '%f\n' | head -n 1)
[[ -n "$torch_wheel" ]] || fail "no torch wheel in $wheels"
log "torch wheel: $torch_wheel; $(du -sh "$wheels" | cut -f1) in all"
# Served on loopback: the build (network host) reads it without copying it into the context. The URL
# is a build argument, part of the build cache's key: the same port each time when it is free.
"$py" - "$wheels" "$TMP/port" >"$TMP/http.log" 2>&1 <<'EOF' &
import functools, http.server, os, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
for port in (38917, 38918, 38919, 0):
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        break
    except OSError:
        continue
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
server.serve_forever()
EOF
SERVER_PID=$!
for _ in $(seq 1 50); do [[ -s "$TMP/port" ]] && break; sleep 0.1; done
[[ -s "$TMP/port" ]] || { cat "$TMP/http.log"; fail "wheel server did not start"; }
index="http://127.0.0.1:$(cat "$TMP/port")/"
end

# --- 5. docker build --------------------------------------------------------------------------
begin "docker build"
torch_version=$(sed -n 's/^torch-\([^-]*\)-.*/\1/p' <<<"$torch_wheel")
# The build context has no .git: the commit goes in as a build argument (transformer.commit() needs no torch).
commit=$(PYTHONPATH="$REPO" "$py" -c 'import transformer; print(transformer.commit())')
"$DOCKER" build --network host -f "$REPO/docker/Dockerfile" -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="torch==$torch_version" \
    --build-arg TORCH_INDEX_URL= \
    --build-arg PIP_ARGS="--no-index --find-links $index" \
    --build-arg GIT_COMMIT="$commit" \
    "$REPO" 2>&1 | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done >"$TMP/build.log" ||
    { tail -40 "$TMP/build.log"; fail "docker build (log above)"; }
# When each build step started: where the time goes.
grep -E '^[0-9:]+ (Step [0-9]+/|torch )' "$TMP/build.log" | cut -c1-110 | sed 's/^/   /' || true
log "image $IMAGE: $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
# The images this build replaced, and base images of other keys, leave the cache.
"$DOCKER" images --format '{{.Repository}}:{{.Tag}}' transformer-ci-base | grep -vx "$BASE_IMAGE" |
    xargs -r "$DOCKER" rmi >/dev/null 2>&1 || true
"$DOCKER" image prune -f >/dev/null
end

# --- 6. docker run ----------------------------------------------------------------------------
begin "docker run: checks"
uid=$("$DOCKER" run --rm --network host "$IMAGE" id -u)
[[ "$uid" != 0 ]] || fail "the image runs as root"
"$DOCKER" run --rm --network host "$IMAGE" \
    bash -c 'command -v transformer-train torchrun single_node.sh multi_node.sh >/dev/null' ||
    fail "transformer-train, torchrun or the launch scripts are not on the image's PATH"
log "runs as uid $uid; transformer-train, torchrun, launch scripts on PATH"
where=$("$DOCKER" run --rm --network host "$IMAGE" python -c 'import transformer; print(transformer.__file__)')
[[ "$where" == /opt/venv/lib/python3*/site-packages/transformer/__init__.py ]] ||
    fail "the image imports transformer from $where, not from the wheel installed in /opt/venv"
version=$("$DOCKER" run --rm --network host "$IMAGE" transformer-train --version)
[[ "$version" == "transformer "*" (commit $commit)" ]] || fail "transformer-train --version in the image: '$version' (commit $commit expected)"
log "the installed wheel: $where; $version"
end

out="$TMP/out"
mkdir -p "$out"
chmod 1777 "$out"  # the container's user is not root
begin "docker run: train"
read -r -a train_args <<<"$TRAIN_ARGS"
log "transformer-train ${train_args[*]} hydra.run.dir=/out/run"
set +e
"$DOCKER" run --rm --network host --init -v "$out:/out" "$IMAGE" \
    transformer-train "${train_args[@]}" hydra.run.dir=/out/run >"$TMP/train.log" 2>&1
rc=$?
set -e
tail -15 "$TMP/train.log" | sed 's/^/   /'
((rc == 0)) || fail "transformer-train exited $rc in the container"
ckpts=$(find "$out/run" -type f \( -name '*.pt' -o -name '*.ckpt' \) | sort)
[[ -n "$ckpts" ]] || fail "training exited 0 but wrote no checkpoint (*.pt) under hydra.run.dir"
log "checkpoints: $(tr '\n' ' ' <<<"${ckpts//$out\//}")"
end

# --- 7. two containers as two nodes -----------------------------------------------------------
# Both on the host network, rendezvous and workers on 127.0.0.1 only, 1 CPU worker each, one outputs
# folder mounted in both (a shared file system). Each runs as its own uid: a file's owner says which
# container wrote it, and all must come from the one holding global rank 0. torchrun tells nodes apart
# by address and agent pid, and both containers share the host's address and start their agent as the
# same pid of their own pid namespace: the second reaches loopback by its other name.
read -r -a nodes_args <<<"$NODES_ARGS"
UIDS=(1000 1001)
ADDRS=(127.0.0.1 localhost)
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

start_node() {  # $1 node index, $2 job name (rendezvous id), $3 outputs folder, $4 max restarts
    "$DOCKER" rm -f "$2-node$1" >/dev/null 2>&1 || true  # one a killed earlier run left behind
    "$DOCKER" run -d --name "$2-node$1" --network host --init --user "${UIDS[$1]}:${UIDS[$1]}" \
        -e LOCAL_ADDR="${ADDRS[$1]}" -e OMP_NUM_THREADS=1 -e LOGLEVEL=INFO -v "$3:/workspace/outputs" "$IMAGE" \
        multi_node.sh --nnodes 2 --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "$2" --nproc-per-node 1 \
        --max-restarts "$4" "${nodes_args[@]}" >/dev/null
}

# Starts node 0, waits until its agent hosts the rendezvous store on $port, then starts node 1 (so
# node 1 never hosts it: the endpoint's node must outlive the others, as on a cluster).
start_two_nodes() {  # $1 job name, $2 outputs folder, $3 max restarts
    mkdir -p "$2"
    chmod 1777 "$2"
    start_node 0 "$@"
    local i
    for i in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        [[ "$("$DOCKER" inspect -f '{{.State.Running}}' "$1-node0")" == true ]] ||
            { "$DOCKER" logs "$1-node0" 2>&1 | tail -20; fail "$1-node0 exited before hosting the rendezvous"; }
        sleep 0.2
    done
    ((i < 300)) || fail "$1-node0 hosts no rendezvous on 127.0.0.1:$port after 60 s"
    start_node 1 "$@"
    log "$1: 2 containers, rendezvous 127.0.0.1:$port, uids ${UIDS[*]}, outputs $2"
}

# Waits for both containers; fails with their logs unless both exit 0; checks who wrote what.
finish_two_nodes() {  # $1 job name, $2 outputs folder
    # docker wait in the background: a TERM to this script interrupts the wait and cleanup runs.
    "$DOCKER" wait "$1-node0" "$1-node1" >"$TMP/$1.codes" &
    wait $!
    local codes
    codes=$(tr '\n' ' ' <"$TMP/$1.codes")
    local n
    for n in 0 1; do "$DOCKER" logs "$1-node$n" >"$TMP/$1-node$n.log" 2>&1; done
    if [[ "$codes" != "0 0 " ]]; then
        for n in 0 1; do echo "--- $1-node$n"; tail -25 "$TMP/$1-node$n.log"; done
        fail "$1: the containers exited with $codes"
    fi
    local run="$2/torchrun-$1"
    [[ -f "$run/checkpoints/last.pt" && -f "$run/train.log" && -f "$run/.hydra/config.yaml" ]] ||
        fail "$1: no checkpoints/last.pt, train.log or .hydra/config.yaml in $run: $(find "$2" | head -20)"
    local owners writer
    owners=$(find "$2" -mindepth 1 -printf '%U\n' | sort -u | tr '\n' ' ')
    [[ "$owners" == "${UIDS[0]} " || "$owners" == "${UIDS[1]} " ]] ||
        fail "$1: files in the shared outputs folder written by uids $owners: only global rank 0 may write"
    writer=$(grep -l "run dir /workspace/outputs/torchrun-$1" "$TMP/$1-node0.log" "$TMP/$1-node1.log" | tr '\n' ' ' || true)
    [[ "$writer" == "$TMP/$1-node"?".log " ]] || fail "$1: rank 0's 'run dir' line in '$writer', expected in one log"
    writer=${writer% }
    log "$1: both containers exited 0; global rank 0 in ${writer#"$TMP/"} (uid ${owners% }) wrote all $(find "$2" -type f | wc -l) files"
    "$DOCKER" rm "$1-node0" "$1-node1" >/dev/null
}

begin "two nodes"
start_two_nodes plain "$TMP/nodes/plain" 0
finish_two_nodes plain "$TMP/nodes/plain"
end

begin "two nodes: kill, start"
start_two_nodes restart "$TMP/nodes/restart" 1
for _ in $(seq 1 900); do
    [[ -n "$(find "$TMP/nodes/restart" -name 'step_*.pt' -print -quit 2>/dev/null)" ]] && break
    sleep 0.2
done
first=$(find "$TMP/nodes/restart" -name 'step_*.pt' -printf '%f\n' | sort | head -n 1)
[[ -n "$first" ]] || fail "restart: no checkpoint after 180 s"
"$DOCKER" kill restart-node1 >/dev/null
log "restart: $first written; docker kill restart-node1 (SIGKILL)"
# The restarted agent has the dead one's name (address, pid): it may rejoin once the rendezvous has
# dropped the dead one, 3 missed heartbeats of 5 s after node 0 saw its workers fail (torchrun logs
# that at LOGLEVEL=INFO).
# grep reads the whole log, not -q: under pipefail, -q's early exit can kill `docker logs` with SIGPIPE and
# fail a check whose line is there (it did, once, in CI: "did not restart ... within 60 s" after 1 s).
node0_restarted() { "$DOCKER" logs restart-node0 2>&1 | grep "will restart worker group" >/dev/null; }
for _ in $(seq 1 300); do
    node0_restarted && break
    sleep 0.2
done
node0_restarted ||
    fail "restart: node 0 did not restart its workers within 60 s of the kill"
sleep 20
"$DOCKER" start restart-node1 >/dev/null
log "restart: node 0 restarts its worker group; docker start restart-node1 20 s later"
finish_two_nodes restart "$TMP/nodes/restart"
grep -h "resumed from" "$TMP"/restart-node?.log | sed 's/^/   /'
grep -q "resumed from" "$TMP"/restart-node?.log || fail "restart: the restarted job did not resume from a checkpoint"
end

begin "two nodes: compare weights"
# In the image (torch is there, not necessarily on the host): the tests' own bit-for-bit comparison, from this
# clone's tests/ (the image has the installed package only).
"$DOCKER" run --rm --network host -e PYTHONPATH=/src -v "$REPO/tests:/src/tests:ro" -v "$TMP/nodes:/nodes:ro" \
    "$IMAGE" python -c "
from tests.helpers.checkpoints import assert_same_state
from transformer.training.components.checkpoint import load_checkpoint
a, b = (load_checkpoint(f'/nodes/{j}/torchrun-{j}/checkpoints/last.pt') for j in ('plain', 'restart'))
assert a['trainer']['world_size'] == b['trainer']['world_size'] == 2
assert_same_state(a, b)
print('final weights bit-identical: step', a['trainer']['step'], 'world size 2')" >"$TMP/compare.log" 2>&1 ||
    { tail -20 "$TMP/compare.log"; fail "the killed and restarted two-node run does not end like the uninterrupted one"; }
log "killed and restarted vs uninterrupted: $(tail -n 1 "$TMP/compare.log")"
end
