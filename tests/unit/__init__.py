"""Unit tier (`make test-fast`): no external service and no server process. Pure functions,
the engines and the OpenAI app in-process over the tiny model, configs, the docs and the
house rules."""
