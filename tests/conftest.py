"""Shared test setup: import the project from the checkout, never touch the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The package may not be pip-installed (CI runs pytest from the checkout).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
