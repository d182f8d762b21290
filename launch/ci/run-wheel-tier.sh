#!/usr/bin/env bash
# CI's wheel tier: the package as `pip install` gives it to a user, away from the clone. It
#   1. builds an sdist and a wheel from the clone (python -m build: the wheel is built from the sdist) and
#      checks that the sdist carries conf/ and the wheel transformer/conf/ (every *.yaml) and the commit;
#   2. creates a fresh venv in a temp dir and installs the wheel into it with constraints-cpu.txt (CPU torch);
#   3. from a temp working directory (not the clone, which is never on sys.path): transformer-train
#      --version, a few steps of the copy task, transformer-translate and transformer-evaluate on its
#      checkpoint.
# Usage: launch/ci/run-wheel-tier.sh [-h]
# Environment: TIER_PYTHON (default: the repository's .venv/bin/python, which has `build` from the test
#   extra, else python3), TIER_TRAIN_ARGS (default "experiment=copy trainer.max_steps=20" and a tiny model),
#   TIER_KEEP=1 keeps the temp dir (the venv, the dist files, the run).
# Exit 0 on success, else the failing status. Needs pip to reach an index (PyPI or a mirror) for the
# dependencies; python -m build fetches setuptools and wheel into its isolated build environment.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TIER="wheel-tier"
# shellcheck source=launch/ci/tier-lib.sh
source "$REPO/launch/ci/tier-lib.sh"
TRAIN_ARGS=${TIER_TRAIN_ARGS:-experiment=copy trainer.max_steps=20 checkpoint.every_steps=10 trainer.val_every=10 trainer.progress=false model.N=1 model.d_model=32 model.d_ff=64 model.h=2 data.copy.train_size=640 data.copy.val_size=48 data.copy.test_size=16}

case "${1:-}" in
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    "") ;;
    *) echo "run-wheel-tier.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

if [[ -n "${TIER_PYTHON:-}" ]]; then py=$TIER_PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then py=$REPO/.venv/bin/python
else py=python3; fi

TMP=""
cleanup() {
    local rc=$?
    set +e
    begin_cleanup
    if [[ -n "$TMP" && -d "$TMP" ]]; then
        if [[ "${TIER_KEEP:-0}" == 1 ]]; then log "kept $TMP"; else rm -rf "$TMP"; log "removed $TMP"; fi
    fi
    finish_tier "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
TMP=$(mktemp -d /tmp/transformer-wheel.XXXXXX)

# --- 1. build ---------------------------------------------------------------------------------
begin "build sdist and wheel"
"$py" -c "import build" 2>/dev/null || fail "$py has no 'build' package (pip install -e '.[test]', or set TIER_PYTHON)"
"$py" -m build --outdir "$TMP/dist" "$REPO" >"$TMP/build.log" 2>&1 || { tail -30 "$TMP/build.log"; fail "python -m build"; }
sdist=$(find "$TMP/dist" -name 'transformer-*.tar.gz' | head -n 1)
wheel=$(find "$TMP/dist" -name 'transformer-*.whl' | head -n 1)
[[ -n "$sdist" && -n "$wheel" ]] || fail "python -m build made no sdist or no wheel: $(ls "$TMP/dist")"
want=$(cd "$REPO" && find conf -name '*.yaml' | sort)
in_sdist=$(tar tzf "$sdist" | sed -n 's|^[^/]*/\(conf/.*\.yaml\)$|\1|p' | sort)
[[ "$in_sdist" == "$want" ]] || fail "the sdist's conf/ differs from the clone's: $(diff <(echo "$want") <(echo "$in_sdist") | tr '\n' ' ')"
in_wheel=$("$py" -c 'import sys, zipfile; print("\n".join(sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist()
    if n.startswith("transformer/conf/") and n.endswith(".yaml"))))' "$wheel" | sed 's|^transformer/||')
[[ "$in_wheel" == "$want" ]] || fail "the wheel's transformer/conf/ differs from the clone's conf/: $(diff <(echo "$want") <(echo "$in_wheel") | tr '\n' ' ')"
recorded=$("$py" -c 'import sys, zipfile; print(zipfile.ZipFile(sys.argv[1]).read("transformer/_commit.txt").decode().strip())' "$wheel")
[[ "$recorded" != unknown ]] || fail "the wheel recorded no commit (transformer/_commit.txt says unknown)"
log "$(basename "$sdist") and $(basename "$wheel"): $(wc -l <<<"$want") conf files each, commit $recorded"
end

# --- 2. install --------------------------------------------------------------------------------
begin "fresh venv, pip install wheel"
"$py" -m venv "$TMP/venv"
bin=$TMP/venv/bin
# --no-compile: byte-compiling all of torch took half of this phase here; what runs compiles what it imports.
"$bin/python" -m pip install -q --no-compile -c "$REPO/constraints-cpu.txt" "$wheel" >"$TMP/pip.log" 2>&1 ||
    { tail -30 "$TMP/pip.log"; fail "pip install of the wheel"; }
log "installed: $("$bin/python" -m pip list 2>/dev/null | grep -cE '^[A-Za-z]') packages, $(du -sh "$TMP/venv" | cut -f1)"
end

# --- 3. use it away from the clone -------------------------------------------------------------
work=$TMP/work
mkdir -p "$work"
cd "$work"
# The clone must not be what runs: nothing of it on the path, and the package is the wheel's.
unset PYTHONPATH
export OMP_NUM_THREADS=1
begin "transformer-train --version"
location=$("$bin/python" -c 'import transformer; print(transformer.__file__)')
[[ "$location" == "$TMP/venv/"* ]] || fail "transformer imports from $location, not from the fresh venv"
version=$("$bin/transformer-train" --version)
[[ "$version" == "transformer "*" (commit $recorded)" ]] || fail "transformer-train --version said '$version'"
[[ -z "$(ls -A "$work")" ]] || fail "transformer-train --version wrote into the working directory: $(ls -A "$work")"
log "$version"
end

begin "transformer-train (copy task)"
read -r -a train_args <<<"$TRAIN_ARGS"
log "transformer-train ${train_args[*]} hydra.run.dir=run"
rc=0
"$bin/transformer-train" "${train_args[@]}" hydra.run.dir=run >"$TMP/train.log" 2>&1 || rc=$?
((rc == 0)) || { tail -30 "$TMP/train.log"; fail "transformer-train exited $rc"; }
ckpt=$work/run/checkpoints/last.pt
[[ -f "$ckpt" ]] || fail "no checkpoints/last.pt after training: $(find run | head -20 | tr '\n' ' ')"
grep -h "test_accuracy" "$TMP/train.log" | tail -n 1 | sed 's/^/   /'
end

begin "translate, evaluate"
printf '%s\n' "5 6 7 8 9 10 4 5 6 7" "4 4 9 10 7 8 5 6 10 9" >src.txt  # the copy task's symbols: 4..10
"$bin/transformer-translate" "$ckpt" --beam 2 <src.txt >hyp.txt 2>"$TMP/translate.log" ||
    { tail -20 "$TMP/translate.log"; fail "transformer-translate"; }
[[ $(wc -l <hyp.txt) -eq 2 ]] || fail "transformer-translate wrote $(wc -l <hyp.txt) lines for 2 sentences"
"$bin/transformer-evaluate" "$ckpt" --src src.txt --ref src.txt --beam 1 --out-dir eval >"$TMP/evaluate.log" 2>&1 ||
    { tail -20 "$TMP/evaluate.log"; fail "transformer-evaluate"; }
[[ -n "$(find eval -name '*.json')" ]] || fail "transformer-evaluate wrote no JSON score in eval/: $(ls eval)"
log "translate: $(head -n 1 hyp.txt | cut -c1-60); evaluate: $(tail -n 1 "$TMP/evaluate.log" | cut -c1-100)"
end
