# Two commands on a fresh machine: `make run` and `make test`. Each bootstraps what it needs, idempotently.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CDK := node_modules/.bin/cdk
STAMP := $(VENV)/.bootstrapped

# Caches stay inside ignored folders of the repo.
export JSII_RUNTIME_PACKAGE_CACHE_ROOT := $(CURDIR)/.cache/jsii
export CDK_HOME := $(CURDIR)/.cache/cdk
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip
export npm_config_cache := $(CURDIR)/.cache/npm
export MPLCONFIGDIR := $(CURDIR)/.cache/matplotlib
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export HF_HOME := $(CURDIR)/.cache/huggingface
export HF_HUB_OFFLINE := 1
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export CDK_DISABLE_VERSION_CHECK := 1
export CDK_DISABLE_CLI_TELEMETRY := true
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

ENVS = $(shell $(PY) -c 'import json; print(" ".join(json.load(open("cdk.json"))["context"]["environments"]))')

.PHONY: bootstrap run test synth lint clean manifests manifests-examples
.DEFAULT_GOAL := run

# torch and triton first, by pip, from the pinned constraints (the CPU wheel on local disk): a resolver that
# reached them through another package would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt package.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt torch==2.13.0 triton==3.7.1
	$(PIP) install -q -c constraints.txt -e '.[infra,workloads,kernels,dev]'
	npm ci --no-fund --no-audit --loglevel=error
	touch $@

# checkov pins boto3 and packaging versions that clash with ours: it gets its own virtual environment.
CHECKOV_VENV := .venv-checkov
CHECKOV := $(CHECKOV_VENV)/bin/checkov
CHECKOV_VERSION := 3.3.30
$(CHECKOV):
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q checkov==$(CHECKOV_VERSION)
	touch $@

bootstrap: $(STAMP) $(CHECKOV)

synth: $(STAMP)
	rm -rf cdk.out
	for e in $(ENVS); do $(CDK) synth --no-notices -q -c env=$$e -o cdk.out/$$e; done
	$(PY) -m moe_rl_eks.tools.cli synth-summary cdk.out

# The main job on its embedded default: CloudFormation for every environment, the example runs' manifests, then
# the local RL run (configs/runs/local.yaml) on this machine's CPU.
run: $(STAMP)
	$(MAKE) --no-print-directory synth
	$(MAKE) --no-print-directory manifests-examples
	$(MAKE) --no-print-directory local-run

# Two workers, one a core (pytest-xdist); the tests of one xdist_group run on one worker, one after another: the
# real RL loop's multi-process runs (timing-sensitive: never two at once) and tests that share an expensive module
# or session fixture (built once, not once a worker).
test: $(STAMP) $(CHECKOV)
	$(PY) -m pytest -n 2 --dist loadgroup

lint: $(STAMP)
	$(PY) -m pytest tests -k "lint or nag or checkov"

# A run's manifests: make manifests RUN=<name in configs/runs> [ENV=<environment>] OUTPUTS=<cdk deploy --outputs-file>
RUN ?=
ENV ?=
OUTPUTS ?=
EXAMPLE_OUTPUTS := tests/k8s/data/outputs.example.json
manifests: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make manifests RUN=<name in configs/runs> [ENV=<env>] OUTPUTS=<outputs.json>"; exit 2; }
	$(PY) -m moe_rl_eks.tools.cli manifests --run configs/runs/$(RUN).yaml $(if $(ENV),--env $(ENV)) $(if $(OUTPUTS),--outputs $(OUTPUTS)) --out dist

# Every example run that declares an environment, against the committed example stack outputs.
manifests-examples: $(STAMP)
	for f in $$(grep -l '^environment: *[a-z]' configs/runs/*.yaml); do \
	  $(PY) -m moe_rl_eks.tools.cli manifests --run $$f --outputs $(EXAMPLE_OUTPUTS) --out dist; done

# EP dispatch + combine throughput per backend, after DeepEP's method; results go in workloads/BENCHMARKS.md.
# Arguments: make bench-ep BENCH_EP_ARGS="--ranks 2 4 --reps 3" (see moerl bench-ep --help).
.PHONY: bench-ep
BENCH_EP_ARGS ?= --ranks 2
bench-ep: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-ep $(BENCH_EP_ARGS)

# MoE layer, torch vs triton compute backend, on one GPU; results go in kernels/BENCHMARKS.md.
.PHONY: bench-kernels
bench-kernels: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-kernels $(BENCH_KERNELS_ARGS)

# Trainer micro-batch tokens/s, MFU and peak memory on one GPU; results go in workloads/BENCHMARKS.md.
# Arguments: make bench-train BENCH_TRAIN_ARGS="--shapes 8x8192 --compute triton" (see moerl bench-train --help).
.PHONY: bench-train
bench-train: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-train $(BENCH_TRAIN_ARGS)

# The whole RL loop on this machine (two rollout servers, trainer EP=2 over gloo, orchestrator; ~2-5 min).
.PHONY: local-run
local-run: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli local-run --run configs/runs/local.yaml

# The whole loop on one GPU (configs/runs/gpu.yaml: rollout server and trainer sharing GPU 0, the countdown task;
# ~6-9 min on an H200; RUN_GPU_ARGS=--quick for the short form, and local-run's --numerics, --importance-correction
# and --max-staleness for the exact-numerics A/B's arms, docs/benchmarks.md). It uses the machine's own CUDA build of torch and
# triton in $(PYTHON), installing only this package and its other needs next to them (no CPU bootstrap).
.PHONY: run-gpu
RUN_GPU_ARGS ?=
run-gpu:
	$(PYTHON) -c 'import torch, triton; assert torch.cuda.is_available(), "make run-gpu needs a CUDA GPU"'
	$(PYTHON) -m pip install -q -e '.[workloads,kernels]'
	$(PYTHON) -m moe_rl_eks.tools.cli local-run --run configs/runs/gpu.yaml $(RUN_GPU_ARGS)

# The local real-data example: word problems in Parquet through a chat template and a BPE tokenizer, made here.
.PHONY: run-words
run-words: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli example-data --out runs/word-problems
	$(PY) -m moe_rl_eks.tools.cli local-run --run configs/runs/local-words.yaml

# Synchronous vs asynchronous RL (3 seeds each, interleaved), one rollout server and one trainer rank on their own
# cores; results go in workloads/BENCHMARKS-rl.md. Arguments: make bench-rl BENCH_RL_ARGS="--seeds 0 1 2 3 4 5" (the
# recorded run; 400 synchronous and 600 asynchronous steps per seed by default, ~2.3 min a seed).
.PHONY: bench-rl
bench-rl: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-rl $(BENCH_RL_ARGS)

# PPO (its critic fitted 4 more epochs a batch) vs GRPO on the CPU countdown task (configs/runs/countdown-cpu.yaml),
# 60 steps per seed and arm, ~45 s each; results in workloads/results/cpu-bench-ppo.{json,md}, docs/benchmarks.md.
# Arguments: make bench-ppo BENCH_PPO_ARGS="--seeds 0 1 2 3 4 5".
.PHONY: bench-ppo
bench-ppo: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-ppo $(BENCH_PPO_ARGS)

# Rollout decoding with a group's prompt prefilled once vs per row (CPU); results in workloads/BENCHMARKS-rl.md.
.PHONY: bench-generation
bench-generation: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-generation $(BENCH_GENERATION_ARGS)

# The rollout engine on one CUDA GPU at Qwen3-30B-A3B's shape (random weights) against transformers' generate and
# the weight-read roofline, plus its logprob mismatch with the trainer's forward; results in workloads/BENCHMARKS-rl.md.
# On a GPU machine without this bootstrap: python3 -m moe_rl_eks.tools.bench.rollout --json out.json
.PHONY: bench-rollout
bench-rollout: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-rollout $(BENCH_ROLLOUT_ARGS)

# Weight publication (snapshot, write, fetch, load to the GPU) against the disk's own bandwidth, on a GPU machine;
# results go in workloads/BENCHMARKS.md. Arguments: make bench-weights BENCH_WEIGHTS_ARGS="--dir /nvme/x --layers 12".
.PHONY: bench-weights
BENCH_WEIGHTS_ARGS ?= --dir runs/bench-weights --out runs/bench-weights.json
bench-weights: $(STAMP)
	$(PY) -m moe_rl_eks.tools.cli bench-weights $(BENCH_WEIGHTS_ARGS)

clean:
	rm -rf cdk.out dist runs .pytest_cache

# Build and push the trainer, rollout and orchestrator images (docker buildx, linux/amd64) and print their digests,
# to the stack's repositories: make images OUTPUTS=<cdk deploy --outputs-file> ENV=<environment> TAG=<release tag>
# or under a prefix:       make images REGISTRY=<registry>/<prefix> TAG=<release tag>      [IMAGES_ARGS=--dry-run]
# Versions come from images/versions.env; base image digests are recorded in images/base-images.lock.
.PHONY: images images-args
REGISTRY ?=
TAG ?=
IMAGES_ARGS ?=
images: images-args $(STAMP)
	$(PY) images/build.py $(if $(OUTPUTS),--outputs $(OUTPUTS) --env $(ENV),--registry $(REGISTRY)) --tag $(TAG) $(IMAGES_ARGS)

# Checked before the bootstrap so a call without them costs nothing.
images-args:
	@test -n "$(TAG)" -a \( -n "$(REGISTRY)" -o \( -n "$(OUTPUTS)" -a -n "$(ENV)" \) \) || { echo "usage: make images OUTPUTS=<cdk outputs file> ENV=<env> TAG=<release tag>, or make images REGISTRY=<registry>/<prefix> TAG=<release tag> [IMAGES_ARGS=--dry-run]"; exit 2; }
