"""The champion as one GGUF file, for llama.cpp, Ollama and edge devices.

    export_gguf(cfg, quant="f32")   download -> (merge) -> convert (-> quantize) -> agreement -> record

`tuneloop package --target gguf [--quant f32|bf16|q8_0|q4_k_m] [--version V|ft:...] [--output F]`
(docs/gguf.md):

1. The champion's files (or `version`'s) from the MLflow registry: a Hugging Face folder. A LoRA
   training run registers its adapter merged into the base already (training/train.py
   save_model), so a champion is always whole weights. An `ft:` model id names an adapter-only
   version of `<registered model>-adapters` (finetune/adapters.py): it is merged into the base
   version it was trained on (peft's merge_and_unload, float32) first.
2. llama.cpp's converter (llama_cpp.py, from the llama-cpp-python sdist) writes f32, bf16 or
   q8_0 itself; q4_k_m is llama-quantize of the f32 file. The file goes to
   <home>/gguf/<registered model>-v<version>-<quant>.gguf, or `output`; a ChatML chat template
   also gets an Ollama Modelfile beside it (<file>.Modelfile).
3. The agreement check against the served model: its greedy answers (the slots engine as
   cfg.serving configures it, agreement.py's candidate run) and llama-server's on the GGUF (its
   own chat template through --jinja, temperature 0) on the 24 committed prompts. exact: answers
   equal token for token; word_prefix as agreement.py measures it; prompts_equal: prompts
   llama-server renders and tokenises to the served token ids (a template or tokenizer
   difference, told apart from a numeric one); text_equal: chat-completion texts equal. The bar
   is the serving bar's greedy half, >= 23/24 (teacher-forced top-1 is not measured: llama-server
   gives no log-probabilities of prompt tokens). A file below it is exported anyway, with a
   warning that says by how much. llama-server is built the first time it is needed (~10 min on
   2 cores; cmake and a C++ compiler); check=False (--no-check) records "not measured" instead.
4. The record on the MLflow version: tag `gguf.<quant>` (JSON: file, sha256, size, quant,
   artifact, agreement) and `gguf.<quant>.agreement` (one line for people); the file and its
   answers logged as artifacts of the version's run under gguf/ (upload=False: the path alone).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from tuneloop.config import TuneloopConfig
from tuneloop.finetune.adapters import (
    TAG_BASE_NAME,
    TAG_BASE_VERSION,
    TAG_KIND,
    TAG_MODEL,
    adapters_model_name,
    is_ft_id,
)
from tuneloop.packaging import llama_cpp
from tuneloop.packaging.common import PackagingError, now, registry_version, say
from tuneloop.registry import ModelRegistry, ModelVersionInfo, RegistryError
from tuneloop.serving.agreement import (
    BAR_EXACT,
    BAR_OF,
    MAX_NEW_TOKENS,
    candidate_answers,
    load_prompts,
    prompt_ids,
    word_prefix,
)
from tuneloop.serving.engine import load_model, load_tokenizer

QUANTS = ("f32", "bf16", "q8_0", "q4_k_m")
TAG = "gguf.{quant}"  # JSON: what GGUFExport.record() holds
TAG_AGREEMENT = "gguf.{quant}.agreement"  # one line for people: "24/24 greedy answers equal: passes"
ARTIFACT_DIR = "gguf"
MAX_CONTEXT = 4096  # llama-server's -c: the model's own context when shorter


@dataclass
class GGUFAgreement:
    """llama-server on the GGUF against the served model, greedy, on the committed prompts."""

    exact: int  # answers equal token for token
    prompts: int
    word_prefix: float  # mean share of words the two answers agree on before they part
    prompts_equal: int  # prompts llama-server renders and tokenises to the served token ids
    text_equal: int  # answers whose chat-completion text is the served text (see measure_agreement)
    distinct: int  # different served answers: few means a weak check (a model that answers every prompt alike)
    seconds: float
    answers: list[dict[str, Any]] = field(default_factory=list)  # id, served, gguf, equal, text_equal

    @property
    def passes(self) -> bool:
        return self.exact * BAR_OF >= BAR_EXACT * self.prompts

    @property
    def short(self) -> int:
        """How many more equal answers the bar needs (0 when it passes)."""
        return max(0, math.ceil(BAR_EXACT * self.prompts / BAR_OF) - self.exact)

    def line(self) -> str:
        weak = ""
        if self.distinct * 2 <= self.prompts:
            weak = f"; only {self.distinct} different answer{'s' if self.distinct != 1 else ''}: a weak check"
        return (
            f"{self.exact}/{self.prompts} greedy answers equal to the served model's (word prefix "
            f"{self.word_prefix:.3f}; {self.prompts_equal}/{self.prompts} prompts tokenised alike{weak}): "
            f"{'passes' if self.passes else 'FAILS'} the bar {BAR_EXACT}/{BAR_OF}"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "prompts": self.prompts,
            "word_prefix": round(self.word_prefix, 4),
            "prompts_equal": self.prompts_equal,
            "text_equal": self.text_equal,
            "distinct": self.distinct,
            "passes": self.passes,
        }


@dataclass
class GGUFExport:
    registered_model: str  # `<registered model>-adapters` for an ft: model
    version: str
    model: str  # what clients call it (llama-server's --alias): the registered name or the ft: id
    quant: str
    path: Path
    sha256: str
    size: int  # bytes
    agreement: GGUFAgreement | None  # None: not measured (--no-check)
    context: int  # the -c to serve it with
    artifact: str | None = None  # runs:/<run>/gguf/<file>, when uploaded
    modelfile: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def warning(self) -> str | None:
        """Why not to use it unawares: a failed agreement bar, by how much."""
        a = self.agreement
        if a is None or a.passes:
            return None
        return (
            f"{self.quant}: {a.exact}/{a.prompts} greedy answers equal to the served model's, bar "
            f"{BAR_EXACT}/{BAR_OF}: {a.short} short; exported anyway, use it knowing it answers differently"
        )

    def record(self) -> dict[str, Any]:
        """What the `gguf.<quant>` tag holds."""
        return {
            "file": str(self.path),
            "sha256": self.sha256,
            "size": self.size,
            "quant": self.quant,
            "artifact": self.artifact,
            "agreement": self.agreement.summary() if self.agreement else "not measured",
            "llama_cpp": llama_cpp.LLAMA_CPP_PYTHON,
            "at": now(),
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(path=str(self.path), modelfile=str(self.modelfile) if self.modelfile else None)
        out["warning"] = self.warning
        return out

    def serve_command(self) -> str:
        """The llama-server line that serves it as `tuneloop package` checked it (OpenAI API on :8080)."""
        server = llama_cpp.binary("llama-server")
        program = f"LD_LIBRARY_PATH={server.parent} {server}" if server else "llama-server"
        return f"{program} -m {self.path} --jinja -c {self.context} --host 127.0.0.1 --port 8080 --alias {self.model}"

    def summary(self) -> str:
        lines = [
            f"GGUF of {self.registered_model} v{self.version} ({self.quant}): {self.path}"
            if self.model == self.registered_model
            else f"GGUF of {self.model} ({self.registered_model} v{self.version} merged into its base, "
            f"{self.quant}): {self.path}",
            f"  {self.size / 1e6:.1f} MB, sha256 {self.sha256}",
            "  agreement: " + (self.agreement.line() if self.agreement else "not measured (--no-check)"),
            f"  recorded on the MLflow version: tag {TAG.format(quant=self.quant)}"
            + (f", artifact {self.artifact}" if self.artifact else ""),
            f"  serve it with llama.cpp: {self.serve_command()}",
        ]
        if self.modelfile:
            lines.append(f"  with Ollama: ollama create {self.path.stem} -f {self.modelfile}")
        return "\n".join(lines)


def version_to_export(cfg: TuneloopConfig, version: str | int | None) -> tuple[ModelRegistry, ModelVersionInfo]:
    """The registry and version to export: the champion, a version of the registered model, or
    (an `ft:` model id) the adapter-only version of `<registered model>-adapters` that serves it."""
    if version is not None and is_ft_id(str(version)):
        return _ft_version(cfg, str(version))
    return registry_version(cfg, version)


def _ft_version(cfg: TuneloopConfig, model_id: str) -> tuple[ModelRegistry, ModelVersionInfo]:
    from mlflow.exceptions import MlflowException

    registry = ModelRegistry(cfg.mlflow_tracking_uri, adapters_model_name(cfg))
    try:
        found = registry.client.search_model_versions(f"name='{registry.name}'", max_results=10_000)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = []
    versions = sorted((int(mv.version) for mv in found if (mv.tags or {}).get(TAG_MODEL) == model_id))
    if not versions:
        raise PackagingError(f"no fine-tuned model {model_id!r} in {registry.name!r} ({cfg.mlflow_tracking_uri})")
    return registry, registry.version(versions[-1])


def _merged(adapter: Path, info: ModelVersionInfo, cfg: TuneloopConfig, dst: Path, progress) -> Path:
    """An adapter-only version merged into the base version it was trained on (float32), saved
    as a Hugging Face folder, as a LoRA training run saves its model (training/train.py)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_name, base_version = info.tags.get(TAG_BASE_NAME), info.tags.get(TAG_BASE_VERSION)
    if not base_name or not base_version:
        raise PackagingError(f"{info.uri}: an adapter without its base ({TAG_BASE_NAME}, {TAG_BASE_VERSION} tags)")
    say(progress, f"downloading its base, {base_name} v{base_version}")
    try:
        base_dir = ModelRegistry(cfg.mlflow_tracking_uri, base_name).download(base_version, dst / "base")
    except RegistryError as exc:
        raise PackagingError(f"{info.uri}: its base is gone: {exc}") from None
    say(progress, f"merging the adapter into {base_name} v{base_version} (float32)")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(dst / "merged")
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(dst / "merged")
    say(progress, f"merged: {sum(p.numel() for p in merged.parameters()) / 1e6:.1f} M parameters")
    return dst / "merged"


def default_path(cfg: TuneloopConfig, info: ModelVersionInfo, quant: str) -> Path:
    return cfg.home / "gguf" / f"{info.name}-v{info.version}-{quant}.gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def export_gguf(
    cfg: TuneloopConfig,
    quant: str = "f32",
    version: str | int | None = None,
    output: Path | None = None,
    check: bool = True,
    upload: bool = True,
    progress: Callable[[str], None] | None = None,
) -> GGUFExport:
    """The champion (or `version`) as a GGUF file, checked against the served model and recorded
    on its MLflow version. Raises PackagingError for what cannot be done (unknown quant, no
    champion, a failed conversion); a file below the agreement bar is exported, with a warning."""
    if quant not in QUANTS:
        raise PackagingError(f"unknown quant {quant!r}: one of {', '.join(QUANTS)}")
    registry, info = version_to_export(cfg, version)
    out = Path(output) if output else default_path(cfg, info, quant)
    if out.is_dir() or out.suffix != ".gguf":  # a folder: the default name in it
        out = out / default_path(cfg, info, quant).name
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        t = time.perf_counter()
        say(progress, f"downloading {info.name} v{info.version} ({info.source})")
        folder = registry.download(info.version, Path(tmp) / "download")
        if info.tags.get(TAG_KIND) == "lora-adapter":
            folder = _merged(folder, info, cfg, Path(tmp), progress)
        if not (folder / "config.json").exists():
            raise PackagingError(f"{info.uri} ({info.source}): not a Hugging Face model folder (no config.json)")
        seconds["download"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        if quant in llama_cpp.CONVERTER_TYPES:
            llama_cpp.convert(folder, out, quant, progress)
        else:
            f32 = llama_cpp.convert(folder, Path(tmp) / "f32.gguf", "f32", progress)
            llama_cpp.quantize(f32, out, quant, cfg.serving.num_threads, progress)
            f32.unlink()
        seconds["convert"] = round(time.perf_counter() - t, 1)
        context = min(MAX_CONTEXT, _context_length(folder))
        agreement = None
        if check:
            t = time.perf_counter()
            agreement = measure_agreement(folder, out, cfg, _model_name(info), context, progress)
            seconds["agreement"] = round(time.perf_counter() - t, 1)
        modelfile = write_modelfile(folder, out, context)
    result = GGUFExport(
        info.name, info.version, _model_name(info), quant, out, sha256_of(out), out.stat().st_size, agreement, context
    )
    result.modelfile = modelfile
    result.seconds = seconds
    _record(cfg, registry, info, result, upload, progress)
    return result


def _model_name(info: ModelVersionInfo) -> str:
    """What clients call it: the registered name, or the fine-tuned model's `ft:` id."""
    return info.tags.get(TAG_MODEL) or info.name


def _context_length(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or text.get("n_positions") or MAX_CONTEXT)


def _record(
    cfg: TuneloopConfig,
    registry: ModelRegistry,
    info: ModelVersionInfo,
    result: GGUFExport,
    upload: bool,
    progress: Callable[[str], None] | None,
) -> None:
    """The tags on the version; the file and its answers as artifacts of the version's run."""
    client = registry.client
    if upload and info.run_id:
        say(progress, f"logging {result.path.name} ({result.size / 1e6:.0f} MB) to run {info.run_id} under gguf/")
        client.log_artifact(info.run_id, str(result.path), ARTIFACT_DIR)
        if result.agreement is not None:
            with tempfile.TemporaryDirectory() as tmp:
                answers = Path(tmp) / (result.path.stem + ".agreement.json")
                answers.write_text(json.dumps(asdict(result.agreement), indent=2))
                client.log_artifact(info.run_id, str(answers), ARTIFACT_DIR)
        result.artifact = f"runs:/{info.run_id}/{ARTIFACT_DIR}/{result.path.name}"
    client.set_model_version_tag(info.name, info.version, TAG.format(quant=result.quant), json.dumps(result.record()))
    readable = result.agreement.line() if result.agreement else "not measured"
    client.set_model_version_tag(info.name, info.version, TAG_AGREEMENT.format(quant=result.quant), readable)


def exported(cfg: TuneloopConfig, version: str | int | None = None) -> dict[str, dict[str, Any]]:
    """quant -> the `gguf.<quant>` record of the champion (or `version`): what was exported."""
    _, info = version_to_export(cfg, version)
    prefix, out = TAG.split("{")[0], {}
    for key, value in info.tags.items():
        quant = key[len(prefix) :]
        if key.startswith(prefix) and quant in QUANTS:
            out[quant] = json.loads(value)
    return out


# ---- the agreement check ---------------------------------------------------------------------


def measure_agreement(
    folder: Path,
    gguf: Path,
    cfg: TuneloopConfig,
    alias: str = "model",
    context: int = MAX_CONTEXT,
    progress: Callable[[str], None] | None = None,
    prompts: list[dict] | None = None,
) -> GGUFAgreement:
    """The served model (the slots engine as cfg.serving configures it) and llama-server on the
    GGUF, greedy, on the committed prompts (or `prompts`: agreement.text_prompts() for a base
    model that answers no instructions, as the demo's bootstrap model). An answer is equal when its tokens are (llama-server
    returns them): as text, an answer cut at MAX_NEW_TOKENS inside a character ends in U+FFFD in
    transformers' decode and in nothing in llama-server's (text_equal counts the texts alike)."""
    started = time.perf_counter()
    if llama_cpp.binary("llama-server") is None:
        try:
            llama_cpp.build("llama-server", progress)
        except PackagingError as exc:
            raise PackagingError(f"{exc}\n(--no-check exports without the agreement check)") from None
    prompts = prompts or load_prompts()[:BAR_OF]
    say(progress, f"agreement: the served model's greedy answers to {len(prompts)} prompts (slots engine)")
    loaded = load_model(folder, cfg.serving.num_threads, cfg.serving.dtype)
    ids = prompt_ids(loaded, prompts)
    served = candidate_answers(loaded, cfg.serving, ids, MAX_NEW_TOKENS)
    served = [_without_stops(a, loaded.stop_ids) for a in served]
    decode, stop_ids = loaded.tokenizer.decode, loaded.stop_ids
    del loaded
    say(progress, f"agreement: llama-server's greedy answers on {gguf.name}")
    threads = cfg.serving.num_threads or os.cpu_count() or 2
    answers, prompts_equal = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "llama-server.log"
        with llama_cpp.serve(gguf, alias, context, threads, log_path) as url, httpx.Client(timeout=300) as http:
            for prompt, want_ids, want in zip(prompts, ids, served):
                greedy = {"temperature": 0, "cache_prompt": False}
                if "prompt" in prompt:
                    text = prompt["prompt"]
                else:
                    template = http.post(f"{url}/apply-template", json={"messages": prompt["messages"]})
                    text = template.raise_for_status().json()["prompt"]
                tokens = http.post(f"{url}/tokenize", json={"content": text, "add_special": True})
                prompts_equal += tokens.raise_for_status().json()["tokens"] == want_ids
                # The chat route's own steps (template, tokenise with specials, generate), with the
                # token ids, which its logprobs leave out where a token ends inside a character.
                body = {**greedy, "prompt": text, "n_predict": MAX_NEW_TOKENS, "return_tokens": True}
                done = http.post(f"{url}/completion", json=body).raise_for_status().json()
                got, got_text = _without_stops(done["tokens"], stop_ids), done["content"]
                if "messages" in prompt:  # what an OpenAI client reads
                    body = {**greedy, "messages": prompt["messages"], "max_tokens": MAX_NEW_TOKENS}
                    chat = http.post(f"{url}/v1/chat/completions", json=body).raise_for_status().json()
                    got_text = chat["choices"][0]["message"]["content"] or ""
                want_text = decode(want, skip_special_tokens=True)
                answers.append(
                    {
                        "id": prompt.get("id"),
                        "served": want_text,
                        "gguf": got_text,
                        "equal": got == want,
                        "text_equal": got_text == want_text,
                        # as agreement.py measures it: both answers through the one tokenizer
                        "word_prefix": word_prefix(want_text, decode(got, skip_special_tokens=True)),
                    }
                )
                if len(answers) % 8 == 0 and len(answers) < len(prompts):  # a large model takes minutes
                    equal = sum(a["equal"] for a in answers)
                    say(progress, f"agreement: {len(answers)}/{len(prompts)} answered, {equal} equal so far")
    return GGUFAgreement(
        exact=sum(a["equal"] for a in answers),
        prompts=len(answers),
        word_prefix=sum(a["word_prefix"] for a in answers) / max(len(answers), 1),
        text_equal=sum(a["text_equal"] for a in answers),
        distinct=len({a["served"] for a in answers}),
        prompts_equal=prompts_equal,
        seconds=round(time.perf_counter() - started, 1),
        answers=answers,
    )


def _without_stops(ids: list[int], stop_ids) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in stop_ids:
        ids.pop()
    return ids


# ---- Ollama ------------------------------------------------------------------------------------

_CHATML = '''TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""'''


def write_modelfile(folder: Path, gguf: Path, context: int) -> Path | None:
    """An Ollama Modelfile beside the GGUF (<file>.Modelfile, FROM the file next to it) where the
    chat template is ChatML, the default system prompt included (SmolLM2's names itself), with
    the served model's stop tokens; None for any other template (docs/gguf.md: write your own)."""
    try:
        loaded = load_tokenizer(folder)
        tok = loaded.tokenizer
        render = lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # noqa: E731
        alone = render([{"role": "user", "content": "U"}])
        with_system = render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    except Exception:  # no chat template, or one that needs what it was not given
        return None
    head, end = "<|im_start|>system\n", "<|im_end|>\n"
    turn = "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    if with_system != f"{head}S{end}{turn}" or not alone.endswith(turn):
        return None
    default_system = alone[: -len(turn)]
    if default_system and not (default_system.startswith(head) and default_system.endswith(end)):
        return None
    lines = [f"FROM ./{gguf.name}", "", _CHATML]
    if default_system:
        lines.append(f'SYSTEM """{default_system[len(head) : -len(end)]}"""')
    lines += [f'PARAMETER stop "{tok.decode([i])}"' for i in sorted(loaded.stop_ids)]
    lines.append(f"PARAMETER num_ctx {context}")
    path = gguf.with_suffix(".Modelfile")
    path.write_text("\n".join(lines) + "\n")
    return path
