"""End-to-end tier: the flows end to end, the closed loop, the real SmolLM2 model and the
Prefect deployments."""
