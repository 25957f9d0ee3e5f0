"""Shared test setup for every tier (tests/unit, tests/integration, tests/e2e): import the
project from the checkout, never touch the network, and the fixtures more than one module uses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The package may not be pip-installed (CI runs pytest from the checkout).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.serving_tiny_model import build_tiny_model  # noqa: E402  (the checkout is on sys.path now)

# No hub downloads in tests: offline machines fail slowly otherwise (retries).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The real public datasets kept next to the checkout (../shared/data), or a skip."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real test data not present at {SHARED_DATA}")
    return SHARED_DATA


os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def demo_base_model() -> Path:
    """The default bootstrap base model, built once into the checkout's cache (.tuneloop/),
    the same folder `make demo` uses, so the suite and the demo pay for it once."""
    from tuneloop.bootstrap import ensure_base_model
    from tuneloop.config import load_config

    cfg = load_config(ROOT / "configs" / "default.yaml", environ={})
    return Path(ensure_base_model(cfg))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny serving model's folder (tests/support/serving_tiny_model.py), built once per run.
    Read only: a test that changes a model builds its own."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def loaded(tiny_model_dir):
    """The tiny model loaded for serving (one thread), shared by every in-process engine and
    API test. Tests may not change it for good: the engines hand back what they change (the
    attention implementation, a compiled layer) when they stop, and a test that sets something
    on it (a config attribute) puts it back in a `finally`. Tests that swap weights load their
    own models (test_hotswap.py, test_fused_forward.py)."""
    from tuneloop.serving.engine import load_model

    return load_model(tiny_model_dir, num_threads=1)
