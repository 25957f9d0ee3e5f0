"""Serving: the OpenAI-compatible API over three generation engines (see bentos/service.py).

- engine.py: GenerationStream, the adaptive engine's BatchGenerator, ContinuousEngine
- slots.py: SlotEngine (the default): iteration-level batching over per-request KV-cache slots
- engine_process.py: EngineProcess, the SlotEngine in a child process (the default: serving.engine_process)
- openai_api.py: schemas, FastAPI app, SSE, error handlers
- errors.py: the one error family and its OpenAI/HTTP mapping
- admission.py: bounded admission (429) and per-request deadlines (504)
- metrics.py: Prometheus metrics (names documented there)
- setup.py: from ServingConfig to a ready OpenAIServer (model folder, names, warm-up)

Nothing here imports BentoML: bentos/service.py is the wiring, and tests can run the
API in-process with the continuous engine.
"""
