"""From configuration to a served model: which folder, which names, warm-up.

Where the model folder comes from, first match wins:
  1. serving.bento_model (a BentoML model tag) -- resolved by bentos/service.py, which
     declares it as a bentoml.models.BentoModel so a built bento carries the model;
  2. serving.model_dir (env TUNELOOP_SERVE_MODEL_DIR);
  3. the configured base model (model.base_model; "bootstrap" = `tuneloop bootstrap`'s folder).
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneloop.config import ServingConfig, TuneloopConfig
from tuneloop.serving.engine import GenerationStream, SamplingParams
from tuneloop.serving.errors import ServingSetupError  # noqa: F401  (raised here; callers import it from here too)


@dataclass
class ServedModel:
    name: str
    version: str
    aliases: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def ids(self) -> list[str]:
        """Every name a request may use: name:version first, then the aliases."""
        out = [self.id]
        for alias in [*self.aliases, self.name]:
            if alias not in out:
                out.append(alias)
        return out


def resolve_model_dir(cfg: TuneloopConfig) -> Path:
    """The model folder to serve when no BentoML model is configured."""
    serving = cfg.serving
    path = cfg.resolve(serving.model_dir) if serving.model_dir else Path(cfg.base_model_ref)
    if not (path / "config.json").exists():
        hint = (
            "run `tuneloop bootstrap` first"
            if cfg.model.base_model == "bootstrap" and not serving.model_dir
            else "set serving.model_dir (or TUNELOOP_SERVE_MODEL_DIR) to a Hugging Face model folder"
        )
        raise ServingSetupError(f"no model to serve at {path} (no config.json there): {hint}")
    return path


def served_model(serving: ServingConfig) -> ServedModel:
    return ServedModel(name=serving.model_name, version=serving.model_version, aliases=list(serving.aliases))


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's reach.

    Called once the model is loaded, compiled and warmed up. The server's heap is then
    ~800k objects (torch, transformers, inductor's graphs), and a full collection walked
    them all: ~470 ms with the GIL held, so every stream stalled, at random moments under
    load. Frozen objects are never scanned again; they stay alive anyway. Garbage is
    collected first, so nothing collectable is frozen.
    """
    gc.collect()
    gc.freeze()


async def warm_up(server: Any, requests: int, max_new_tokens: int = 2) -> float:
    """Generate a few short completions through the server's backend; mark it ready. Returns seconds.

    One request alone first (first-call costs), then the rest at once: through the
    adaptive engine that also runs BentoML's batcher through its calibration phase, so the
    first real clients already get real batches. Then the heap is frozen (freeze_heap).
    """
    started = time.perf_counter()
    prompt = server.loaded.encode("Hello, how are you?")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    async def one(i: int) -> None:
        stream = GenerationStream(f"warmup-{i}", prompt, params)
        server.backend.submit(stream)
        async for _ in stream.events():
            pass

    if requests > 0:
        await one(0)
        await asyncio.gather(*(one(i) for i in range(1, requests)))
    freeze_heap()
    server.ready = True
    return time.perf_counter() - started
