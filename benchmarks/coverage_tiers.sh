#!/usr/bin/env bash
# Line coverage of transformer/ per module over the CPU tiers that run in this venv (fast, slow, distributed:
# `pytest -m "not docker and not slurm and not gpu"`), every process counted: spawned and torchrun workers and
# the commands' subprocesses start coverage through a .pth file while COVERAGE_PROCESS_START is set. Copies of
# the package that tests make under /tmp are left out. The tables of docs/benchmarks/coverage.md come from it.
# Usage: make coverage   (or: bash benchmarks/coverage_tiers.sh [extra pytest arguments])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import coverage" 2>/dev/null || "$PY" -m pip install -q 'coverage>=7.6'
work=$(mktemp -d)
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$work/coveragerc" <<RC
[run]
parallel = True
source_pkgs = transformer
sigterm = True
data_file = $work/data
omit = /tmp/*
RC
echo "import coverage; coverage.process_startup()" > "$site/zz_coverage.pth"
trap 'rm -f "$site/zz_coverage.pth"' EXIT
start=$(date +%s)
status=0
COVERAGE_PROCESS_START=$work/coveragerc "$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist worksteal -q -p no:cacheprovider \
  -m "not docker and not slurm and not gpu" "$@" || status=$?
echo "=== pytest exit $status after $(( $(date +%s) - start )) s (a failing test stops partway: its modules may read lower)"
"$PY" -m coverage combine --rcfile "$work/coveragerc" -q
"$PY" -m coverage report --rcfile "$work/coveragerc"
echo "=== coverage data: $work/data"
