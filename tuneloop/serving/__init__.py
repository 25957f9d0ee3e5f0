"""Serving: the OpenAI-compatible API over three generation engines (see bentos/service.py).

- engine.py: what every engine shares: GenerationStream, SamplingParams, LoadedModel, load_model
- sampling.py: per-request sampling (temperature, top_p, seed, penalties, logprobs) in a shared batch
- slots.py: SlotEngine (the default): iteration-level batching over per-request KV-cache slots;
  its scheduler (slots.py), model runner (slot_runner.py) and KV cache (slot_cache.py)
- adaptive_engine.py: BatchGenerator, one padded `generate` per batch BentoML collected
- continuous_engine.py: ContinuousEngine, transformers' continuous batching manager
- vllm_engine.py: VLLMEngine, vLLM's OpenAI server in a process of its own
- engine_process.py: EngineProcess, the SlotEngine in a child process (the default: serving.engine_process)
- (the HTTP API over these engines is tuneloop/api/, the layer above)
- errors.py: the one error family and its OpenAI/HTTP mapping
- admission.py: bounded admission (429) and per-request deadlines (504)
- metrics.py: Prometheus metrics (names documented there)
- setup.py: from ServingConfig to a ready OpenAIServer (model folder, names, warm-up)

Nothing here imports BentoML: bentos/service.py is the wiring, and tests can run the
API in-process with the continuous engine.
"""
