"""What the tests share that is not a test: starting real services (servers.py), the tiny
serving model (serving_tiny_model.py), and the helpers more than one test module uses. No
test module imports another; each imports what it shares from here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/support/ is two levels down
