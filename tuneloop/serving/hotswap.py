"""A running server follows the registry's champion: a new champion's weights are swapped
into the engine without a restart and without a dropped request (serving.follow_champion).

BentoML has no hot swap of its own. The choice here is an in-process swap: the new version
is downloaded and loaded off the event loop; then new generations wait at a gate while the
admitted ones finish on the old weights, the engine copies the new weights in place at a
step boundary (SlotEngine.swap_weights), and the gate opens. Each request is answered by one
version, end to end, and is told which (its `model`); the wait is at most the longest
generation in flight. Then the server
reports the new version (`/v1/models`, every response's `model`, the request log, metrics).
Only a version of the same architecture and tokenizer can be swapped in; anything else is
logged once ("restart to serve it") and the server keeps serving what it has. A rollback is
a champion change like any other, so it is followed the same way. The LoRA adapters the
engine held are dropped with the old weights they were trained on (SlotRunner.load_weights);
an adapter asked for afterwards is read again from its folder, onto the new weights.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tuneloop.registry import ModelRegistry
from tuneloop.serving.engine import _model_folder
from tuneloop.serving.setup import ServedModel

log = logging.getLogger("bentoml.tuneloop.hotswap")
_IGNORED = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "_commit_hash"}


def _config_of(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in _IGNORED}


class ChampionWatcher:
    def __init__(self, cfg, server, engine, poll_s: float, metrics=None):
        self.cfg, self.server, self.engine = cfg, server, engine
        self.poll_s = float(poll_s)
        self.metrics = metrics
        self.skipped: set[str] = set()  # versions that cannot be swapped in (said once)
        self.swaps = 0

    @staticmethod
    def applies(cfg, served: ServedModel, engine) -> str | None:
        """Why this server cannot follow the champion, or None when it can."""
        if served.name != cfg.mlflow.registered_model or not str(served.version).isdigit():
            return f"it serves {served.id}, not a version of the registered model {cfg.mlflow.registered_model}"
        if not hasattr(engine, "swap_weights"):
            return f"the {getattr(engine, 'engine', 'adaptive')} engine cannot swap weights (the slots engine can)"
        return None

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the registry may be down for a while: keep serving, try again
                log.exception("following the champion failed; retrying in %g s", self.poll_s)
            await asyncio.sleep(self.poll_s)

    async def check(self) -> bool:
        """One look at the registry; swaps when the champion moved. True when it swapped."""
        champion = await asyncio.to_thread(lambda: ModelRegistry.from_config(self.cfg).champion())
        if champion is None or champion.version == self.server.served.version or champion.version in self.skipped:
            return False
        log.info("the champion is now version %s (serving %s): loading it", champion.version, self.server.served.id)
        try:
            state, folder = await asyncio.to_thread(self._load, champion.version)
        except ValueError as exc:
            self.skipped.add(champion.version)
            log.error("version %s cannot be swapped in (%s); restart the server to serve it", champion.version, exc)
            return False
        # New generations wait at the gate; the ones admitted finish on the old weights.
        gate = self.server.swap_gate = asyncio.Event()
        old = self.server.served
        try:
            while self.server.admission.in_flight > 0:
                await asyncio.sleep(0.01)
            done = self.engine.swap_weights(state, folder)
            await asyncio.to_thread(done.wait)
            if self.engine.swap_error is not None:
                self.skipped.add(champion.version)
                return False
            self.server.served = ServedModel(old.name, champion.version, list(old.aliases))
        finally:
            self.server.swap_gate = None
            gate.set()
        if self.metrics is not None:
            self.metrics.serving(old.id, self.server.served.id)
        self.swaps += 1
        log.info("now serving %s (was %s), no restart", self.server.served.id, old.id)
        return True

    def _load(self, version: str) -> tuple[dict, Path]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = self.cfg.home / "models" / f"{self.cfg.mlflow.registered_model}-v{version}"
        found = sorted(target.glob("**/config.json"))
        if not found:
            ModelRegistry.from_config(self.cfg).download(version, target)
            found = sorted(target.glob("**/config.json"))
        folder = _model_folder(found[0].parent if found else Path(target))
        loaded = self.server.loaded
        if loaded.model is not None:
            served_config, dtype = loaded.model.config, loaded.model.dtype
        else:  # the weights are in the engine's process (serving.engine_process): it says their dtype
            from transformers import AutoConfig

            served_config, dtype = AutoConfig.from_pretrained(loaded.path), self.engine.dtype
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        if _config_of(model.config) != _config_of(served_config):
            raise ValueError("its model config differs from the served model's")
        if AutoTokenizer.from_pretrained(folder).get_vocab() != loaded.tokenizer.get_vocab():
            raise ValueError("its tokenizer differs from the served model's")
        return model.state_dict(), folder
