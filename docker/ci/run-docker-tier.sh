#!/usr/bin/env bash
# CI's Docker tier: builds docker/Dockerfile and trains in the container, on a machine that has no
# container registry, only Debian's and PyPI's package registries. As root it:
#   1. installs docker.io and debootstrap with apt-get when missing;
#   2. starts a private dockerd (no bridge, no iptables, data under a temp dir; stopped on exit);
#   3. imports a Debian bookworm base image made with debootstrap (tarball cached);
#   4. builds a wheelhouse of the project's dependencies on the host, with constraints-cpu.txt (cached),
#      and serves it to the build on 127.0.0.1;
#   5. docker build --network host of docker/Dockerfile on that base, offline (--no-index);
#   6. docker run --network host: non-root user, then a short training run whose exit code and
#      checkpoint are checked (an import check while transformer/train.py does not exist yet).
# Usage: docker/ci/run-docker-tier.sh [-h] [--mirror]
#   --mirror  only print the Debian mirror read from the apt sources, and exit
# Environment: TIER_CACHE (default /var/cache/transformer-ci), TIER_MIRROR, TIER_PYTHON (python3),
#   TIER_TRAIN_ARGS (default "experiment=copy trainer.max_steps=20 checkpoint.every_steps=10
#   trainer.progress=false"),
#   APT_ETC (default /etc/apt), TIER_KEEP=1 keeps the temp dir.
# Exit 0 on success, 77 when it cannot run here (not root, no apt-get), else the failing status.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${TIER_CACHE:-/var/cache/transformer-ci}
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python3-pip
BASE_IMAGE=transformer-ci-base
IMAGE=transformer-ci
TRAIN_ARGS=${TIER_TRAIN_ARGS:-experiment=copy trainer.max_steps=20 checkpoint.every_steps=10 trainer.progress=false}

log() { echo "[docker-tier $(date +%H:%M:%S)] $*"; }
fail() { echo "[docker-tier] FAILED: $*" >&2; exit 1; }

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

if [[ $(id -u) -ne 0 ]]; then echo "[docker-tier] SKIP: needs root (apt-get, dockerd)"; exit 77; fi
if ! command -v apt-get >/dev/null 2>&1; then echo "[docker-tier] SKIP: no apt-get on this machine"; exit 77; fi

# Phase timings, printed at the end (and on failure).
declare -a PHASES=()
phase_start=0
phase_open=0
t0=$(date +%s.%N)
begin() { phase_name=$1; phase_start=$(date +%s.%N); phase_open=1; log "== $1"; }
end() {
    phase_open=0
    local secs
    secs=$(awk -v a="$phase_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    PHASES+=("$(printf '%-28s %7ss' "$phase_name" "$secs")")
    log "   $phase_name: ${secs}s"
}
report() {
    echo "[docker-tier] phase timings:"
    local p
    for p in "${PHASES[@]}"; do echo "  $p"; done
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "  %-28s %7.1fs\n", "total", b - a }'
}

TMP=""
DOCKERD_PID=""
SERVER_PID=""
cleanup() {
    local rc=$?
    set +e
    if ((phase_open == 1)); then phase_name="$phase_name (failed)"; end; fi
    ((${#PHASES[@]} == 0)) || begin "cleanup"
    if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
    if [[ -n "$DOCKERD_PID" ]]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$DOCKERD_PID" 2>/dev/null
        wait "$DOCKERD_PID" 2>/dev/null
        log "dockerd stopped"
    fi
    if [[ -n "$TMP" && -d "$TMP" ]]; then
        # Whatever dockerd left mounted (overlay layers, netns) must go before the files do.
        awk -v t="$TMP" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount -l
        if [[ "${TIER_KEEP:-0}" == 1 ]]; then log "kept $TMP"; else rm -rf "$TMP"; log "removed $TMP"; fi
    fi
    ((${#PHASES[@]} == 0)) || { end; report; }
    if ((rc == 0)); then echo "[docker-tier] OK"; else echo "[docker-tier] FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TMP=$(mktemp -d /tmp/transformer-docker.XXXXXX)
mkdir -p "$CACHE"

# --- 1. packages ------------------------------------------------------------------------------
begin "apt: docker.io debootstrap"
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
if ((${#missing[@]} > 0)); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$TMP/apt.log" 2>&1 ||
        { tail -20 "$TMP/apt.log"; fail "apt-get install ${missing[*]}"; }
fi
# The daemon is 20.10 from Debian; a newer docker client elsewhere on PATH negotiates down to it.
DOCKER=docker
command -v docker >/dev/null 2>&1 || fail "no docker client after installing docker.io"
end

# --- 2. dockerd -------------------------------------------------------------------------------
begin "start dockerd"
export DOCKER_HOST="unix://$TMP/docker.sock"
# The classic builder: no buildx plugin is needed and --network host applies to RUN steps.
export DOCKER_BUILDKIT=0
dockerd --bridge=none --iptables=false --ip6tables=false --data-root="$TMP/data" \
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
"$DOCKER" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' "$base_tar" "$BASE_IMAGE" >/dev/null
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
    # The project's wheel only drives the resolver; the image installs the project from source.
    # setuptools and wheel are its build requirements (pyproject.toml).
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
# Served on loopback: the build (network host) reads it without copying it into the context.
"$py" - "$wheels" "$TMP/port" >"$TMP/http.log" 2>&1 <<'EOF' &
import functools, http.server, os, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
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
"$DOCKER" build --network host -f "$REPO/docker/Dockerfile" -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="torch==$torch_version" \
    --build-arg TORCH_INDEX_URL= \
    --build-arg PIP_ARGS="--no-index --find-links $index" \
    "$REPO" 2>&1 | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done >"$TMP/build.log" ||
    { tail -40 "$TMP/build.log"; fail "docker build (log above)"; }
# When each build step started: where the time goes.
grep -E '^[0-9:]+ (Step [0-9]+/|torch )' "$TMP/build.log" | cut -c1-110 | sed 's/^/   /' || true
log "image $IMAGE: $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
end

# --- 6. docker run ----------------------------------------------------------------------------
begin "docker run: checks"
uid=$("$DOCKER" run --rm --network host "$IMAGE" id -u)
[[ "$uid" != 0 ]] || fail "the image runs as root"
"$DOCKER" run --rm --network host "$IMAGE" \
    bash -c 'command -v transformer-train torchrun single_node.sh multi_node.sh >/dev/null' ||
    fail "transformer-train, torchrun or the launch scripts are not on the image's PATH"
log "runs as uid $uid; transformer-train, torchrun, launch scripts on PATH"
end

out="$TMP/out"
mkdir -p "$out"
chmod 1777 "$out"  # the container's user is not root
if [[ -f "$REPO/transformer/train.py" ]]; then
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
else
    begin "docker run: import (no trainer yet)"
    "$DOCKER" run --rm --network host "$IMAGE" \
        python -c "import transformer, torch, hydra, spacy, tokenizers, sacrebleu; print('imports ok, torch', torch.__version__)"
    end
fi
