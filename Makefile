# Set-up and checks. `make train` and `make test` are the README's two quick-start commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest
# The fast and slow tiers run on pytest-xdist workers (tests/conftest.py shares the cores out among them):
# their end-to-end tests wait on process starts and subprocesses, which a second worker fills. 1 = serial.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal,)
# Test runs write bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on some CI machines):
# without it every pytest worker rewrites every test module and every CLI subprocess compiles the package anew.
unexport PYTHONDONTWRITEBYTECODE
# CPU machines pin the CPU build of torch so pip never pulls a multi-GB CUDA build.
CONSTRAINTS ?= constraints-cpu.txt

.PHONY: install train test test-slow test-wheel test-docker test-slurm test-gpu test-floor gpu-wheels bench-gpu bench-gpu-dry gpu-data \
	train-gpu-multi30k fp8-curve-gpu test-all coverage clean

# One venv, two stamps: .runtime (the package and its runtime dependencies, for `make train`) and .installed
# (with the test extra: pytest, linters, the trackers and export libraries the tests use; for `make test` and
# the other tiers). Either order works: installing the test extra stamps .runtime too, and `make test` after
# `make train` adds only the test extra.
# --no-compile: pip would byte-compile every file of every package (torch's thousands: about 50 s of a 90-s
# install on 2 cores); Python compiles what is imported, once, on first use (PYTHONDONTWRITEBYTECODE is unexported).
install: $(VENV)/.installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.runtime: setup.cfg setup.py pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed: setup.cfg setup.py pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[test]'
	touch $(VENV)/.runtime $@

train: $(VENV)/.runtime  ## the copy task end to end on this machine (about 1.5 minutes of training on 2 CPU cores)
	$(BIN)/transformer-train experiment=copy

test: install  ## fast CPU tier
	$(PYTEST) $(XDIST) -m "not slow and not distributed and not docker and not slurm and not gpu"

test-slow: install  ## end-to-end runs and multi-process (gloo on 127.0.0.1) tests
	$(PYTEST) $(XDIST) -m "(slow or distributed) and not docker and not slurm and not gpu"

test-wheel: install  ## builds an sdist and a wheel, installs the wheel in a fresh venv, trains from it away from the clone
	TIER_PYTHON=$(BIN)/python bash launch/ci/run-wheel-tier.sh

test-docker: install  ## builds the image from a local base and runs a job in it (needs root)
	$(PYTEST) -m docker

test-slurm: install  ## starts a one-node Slurm cluster (munged, slurmctld, slurmd) and submits jobs to it (needs root)
	TIER_PYTHON=$(BIN)/python bash launch/ci/run-slurm-tier.sh || test $$? -eq 77  # 77: skipped (not root)

# The oldest torch setup.cfg allows, in a venv of its own (pip fetches its CUDA build: no CPU wheel of it here),
# under the tests of the model, decoding, the trainer and the commands. fp8 (torchao) and export (transformers)
# need newer torch and are not in it.
FLOOR_TORCH ?= 2.4.1
FLOOR_VENV ?= .venv-floor
FLOOR_TESTS := tests/model/test_model.py tests/decoding/test_decode.py tests/model/test_flops.py tests/model/test_residual.py \
	tests/model/test_dropout.py tests/training/components/test_loss_optim.py tests/model/test_projections.py tests/training/speed/test_graphs.py \
	tests/training/loop/test_trainer.py tests/cli/test_translate.py tests/cli/test_average.py tests/training/components/test_compat.py tests/cli/test_evaluate.py

$(FLOOR_VENV)/.installed: setup.cfg setup.py pyproject.toml  # once, as install does: torch's download is about 3 GB
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q "torch==$(FLOOR_TORCH)" -e . pytest pytest-timeout pytest-xdist
	touch $@

test-floor: $(FLOOR_VENV)/.installed  ## the core tests under torch $(FLOOR_TORCH), setup.cfg's floor
	$(FLOOR_VENV)/bin/python -m pytest $(XDIST) -m "not slow and not gpu" -p no:warnings $(FLOOR_TESTS)

test-gpu: install  ## needs a CUDA GPU
	$(PYTEST) -m gpu

# On a GPU machine, with the torch it already has: no venv, nothing downloaded (the other dependencies must be
# importable there too). GPU tier + transformer-bench for base and big at the recipes' sizes, 16k and 32k, eager
# and with each switch set (benchmarks/bench_gpu.py's table); records appended to BENCH_OUT, a Markdown summary
# beside it (.md). bench-gpu-dry runs the same plan shrunk on a CPU.
GPU_PYTHON ?= python3
BENCH_OUT ?= outputs/bench-gpu-$(shell date +%Y%m%d-%H%M%S).jsonl
# BENCH_ARGS="--decode-checkpoint RUN/checkpoints/best.pt": decoding speed of a trained model (no spaCy needed)
BENCH_ARGS ?=
# The GPU machines lent to this project have torch, sacreBLEU and tokenizers but not these, and no network:
# `make gpu-wheels` here, then carry .whl with the checkout; bench-gpu installs them into /tmp/site first.
GPU_WHEELS ?= antlr4-python3-runtime==4.9.3 hydra-core==1.3.8 omegaconf==2.3.1 torchao==0.18.0
gpu-wheels: install  ## the wheels bench-gpu needs on a bare GPU machine, into .whl/
	rm -rf .whl && $(BIN)/python -m pip wheel --no-deps -q -w .whl $(GPU_WHEELS)

GPU_SITE = if [ -d .whl ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
	  --upgrade --target /tmp/site .whl/*.whl; fi; PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH}

bench-gpu:  ## GPU tier and GPU benchmarks, under 8 minutes
	$(GPU_SITE) $(GPU_PYTHON) benchmarks/bench_gpu.py --out $(BENCH_OUT) $(BENCH_ARGS)

fp8-curve-gpu:  ## on a GPU machine (sm_89+, .whl): 1,000 steps of bf16 and fp8, the loss curves compared
	$(GPU_SITE) $(GPU_PYTHON) benchmarks/loss_curves.py --device cuda --steps 1000 --variants bf16,fp8

# Issue 48's Multi30k target on a lent GPU: `make gpu-data` here (Multi30k's raw files into data/multi30k, which
# git ignores), carry .whl and data, then `make train-gpu-multi30k GPU_RUN=$$OUT/multi30k`: the recipe with CUDA
# graphs; its last line gives the minutes to validation BLEU 38, its logged lines gpu_util. The run (and its
# checkpoints) stays in GPU_TMP on the machine; train.log and metrics.jsonl are copied to GPU_RUN.
MULTI30K_DIR ?= ../shared/data/multi30k
GPU_RUN ?= outputs/gpu-multi30k
GPU_TMP ?= /tmp/gpu-multi30k
GPU_TRAIN_ARGS ?= speed=graphs trainer.max_minutes=2.5 seed=1234
gpu-data:  ## Multi30k's raw files into data/multi30k, to carry to a GPU machine
	mkdir -p data/multi30k && cp $(MULTI30K_DIR)/*.gz data/multi30k/

train-gpu-multi30k:  ## experiment=multi30k on a GPU machine with CUDA graphs (data/multi30k, .whl)
	$(GPU_SITE) $(GPU_PYTHON) -m transformer.train experiment=multi30k data.root=data/multi30k \
	  hydra.run.dir=$(GPU_TMP) trainer.progress=false $(GPU_TRAIN_ARGS); rc=$$?; \
	  mkdir -p $(GPU_RUN) && cp $(GPU_TMP)/train.log $(GPU_TMP)/metrics.jsonl $(GPU_RUN)/; exit $$rc

bench-gpu-dry: install  ## bench-gpu's plumbing on a CPU, every run shrunk
	$(BIN)/python benchmarks/bench_gpu.py --dry-run --out outputs/bench-gpu-dry.jsonl

test-all: test test-slow test-wheel test-docker test-slurm

coverage: install  ## line coverage of transformer/ per module over the CPU tiers (docs/benchmarks/coverage.md)
	PYTHON=$(BIN)/python bash benchmarks/coverage_tiers.sh

clean:
	rm -rf $(VENV) $(FLOOR_VENV) outputs multirun .pytest_cache
