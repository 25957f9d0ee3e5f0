"""The interface layer: keys, limits, cache, PII, content filter (plain Python, no BentoML)."""
