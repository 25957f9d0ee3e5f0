"""Integration tier: tests that start real services or processes -- Redis, an MLflow or
Prefect server, PostgreSQL, Prometheus, chromium, `bentoml serve`, vLLM, the gateway's
checks and the engine in their own processes, training launchers -- or run the CLI against
them."""
