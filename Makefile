# Two entry points (see README): `make demo` and `make test`. Both install first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS :=
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120

.PHONY: install demo test test-fast clean

# The lock is fully pinned, so pip installs it without backtracking; the project itself
# goes in editable and without dependencies (they all come from the lock).
$(BIN)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --progress-bar off -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/tuneloop demo

test: install
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf .tuneloop
