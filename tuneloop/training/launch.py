"""Start a training job as real processes and wait for it.

A training job is described by a TrainSpec, written to <output_dir>/spec.json, and run by
tuneloop/training/train.py in 1..N processes:

    num_processes == 1   python -m tuneloop.training.train --spec spec.json
                         (RANK/WORLD_SIZE/MASTER_* set: DeepSpeed needs them even alone)
    launcher torchrun    python -m torch.distributed.run --nproc_per_node N -m tuneloop.training.train ...
    launcher deepspeed   python -m deepspeed.launcher.runner --num_gpus N --module tuneloop.training.train ...

The job's output (all ranks, stdout and stderr) is streamed line by line to `on_log`, so a
Prefect task or a terminal shows it live. A failed job raises TrainingError carrying the
last lines of that output. A job relaunched on the same output_dir resumes from its last
complete checkpoint, so retrying a killed job costs at most save_steps steps.

No torch import here: this module is imported by the CLI and the flows.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from tuneloop.config import REPO_ROOT, ConfigError, TrainingConfig, TuneloopConfig, _format_errors
from tuneloop.ports import free_port
from tuneloop.training.recipe import auto_recipe, count_rows

SPEC_FILE = "spec.json"
RESULT_FILE = "train_result.json"
MODEL_SUBDIR = "model"
CHECKPOINTS_SUBDIR = "checkpoints"
LOG_TAIL_LINES = 50


class TrainingError(Exception):
    """A training job failed; the message ends with the last lines of its log."""


@dataclass
class TrainSpec:
    """Everything one training job needs, as plain JSON-able values."""

    name: str  # "cand-0", "cand-1", ...: names the candidate in logs and MLflow
    base_model: str  # a local folder or a hub id, as from_pretrained takes it
    train_path: str  # normalised Examples, JSONL
    eval_path: str | None  # None: no eval loss is computed
    output_dir: str  # spec.json, checkpoints/, model/, train_result.json
    training: dict[str, Any]  # TrainingConfig with this candidate's overrides applied
    deepspeed_config: str | None = None  # absolute path of a DeepSpeed JSON, None: no DeepSpeed
    num_processes: int = 1
    launcher: str = "torchrun"  # "torchrun" | "deepspeed", used when num_processes > 1
    overrides: dict[str, Any] = field(default_factory=dict)  # what makes this candidate differ
    notes: list[str] = field(default_factory=list)  # training.recipe auto: what it chose and why

    @property
    def config(self) -> TrainingConfig:
        return TrainingConfig.model_validate(self.training)

    @property
    def spec_path(self) -> Path:
        return Path(self.output_dir) / SPEC_FILE

    @property
    def model_dir(self) -> Path:
        return Path(self.output_dir) / MODEL_SUBDIR

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.output_dir) / CHECKPOINTS_SUBDIR

    @property
    def result_path(self) -> Path:
        return Path(self.output_dir) / RESULT_FILE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.spec_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return path

    @classmethod
    def load(cls, path: Path | str) -> "TrainSpec":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise TrainingError(f"{path}: not a training spec ({exc})") from None


@dataclass
class TrainResult:
    model_dir: Path  # a plain Hugging Face folder (LoRA already merged)
    train_result: dict[str, Any]  # the job's train_result.json
    spec: TrainSpec


# ---------------------------------------------------------------------------------------
# candidates


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; nested mappings (lora) are merged key by key, not replaced."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _deepspeed_config_path(cfg: TuneloopConfig, path: Path | None, where: str) -> Path | None:
    """The DeepSpeed JSON as an absolute path; the shipped configs/deepspeed/* are found from anywhere."""
    if path is None:
        return None
    resolved = cfg.resolve(path)
    if not resolved.is_file() and not Path(path).is_absolute() and (REPO_ROOT / path).is_file():
        resolved = REPO_ROOT / path  # a config file outside the project naming a shipped config
    if not resolved.is_file():
        raise ConfigError(f"{where}: deepspeed_config {path} not found (looked at {resolved})")
    return resolved


def candidate_specs(
    cfg: TuneloopConfig, dataset_dir: Path | str, run_root: Path | str, start_from: str | None = None
) -> list[TrainSpec]:
    """One TrainSpec per entry of training.candidates (one spec if there are none), each
    starting from `start_from` (a model folder, e.g. the champion's) or the base model.

    Each candidate is a dict of overrides of the training section, validated like the
    section itself, so `{learning_rte: 1e-3}` is a ConfigError, not an ignored setting.
    A run from the champion applies training.continued first (a continued run's schedule).
    """
    dataset_dir, run_root = Path(dataset_dir), Path(run_root)
    train_path = dataset_dir / "train.jsonl"
    eval_path = dataset_dir / "eval.jsonl"
    section = cfg.training.model_dump(mode="json", exclude={"candidates", "kubernetes", "continued"})
    notes: list[str] = []
    candidates = cfg.training.candidates
    if cfg.training.recipe == "auto":
        chosen, searched, notes = auto_recipe(cfg.training, count_rows(train_path), start_from or cfg.base_model_ref)
        section = _merge(section, chosen)
        candidates = candidates or searched
    continued = cfg.training.continued
    if start_from and continued:
        where = f"{cfg.source or 'config'}: training.continued"
        if "candidates" in continued or "continued" in continued:
            raise ConfigError(f"{where}: may not set candidates or continued")
        section = _merge(section, continued)
        try:
            TrainingConfig.model_validate(section)
        except ValidationError as err:
            raise ConfigError(_format_errors(err, where)) from None
    specs = []
    for i, overrides in enumerate(candidates or [{}]):
        where = f"{cfg.source or 'config'}: training.candidates[{i}]"
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}: must be a mapping of training keys, got {overrides!r}")
        if "candidates" in overrides:
            raise ConfigError(f"{where}: a candidate cannot have candidates")
        try:
            training = TrainingConfig.model_validate(_merge(section, overrides))
        except ValidationError as err:
            raise ConfigError(_format_errors(err, where)) from None
        ds = _deepspeed_config_path(cfg, training.deepspeed_config, where)
        specs.append(
            TrainSpec(
                name=f"cand-{i}",
                base_model=start_from or cfg.base_model_ref,
                train_path=str(train_path),
                eval_path=str(eval_path) if eval_path.exists() else None,
                output_dir=str(run_root / f"cand-{i}"),
                training=training.model_dump(mode="json", exclude={"candidates", "kubernetes", "continued"}),
                deepspeed_config=str(ds) if ds else None,
                num_processes=training.num_processes,
                launcher=training.launcher,
                overrides=dict(overrides),
                notes=list(notes)
                + (
                    [f"continued from the champion: {json.dumps(continued, sort_keys=True)}"]
                    if start_from and continued
                    else []
                ),
            )
        )
    return specs


# ---------------------------------------------------------------------------------------
# launching


def training_command(spec: TrainSpec, port: int) -> list[str]:
    """The command line that runs spec as num_processes processes."""
    script = ["--spec", str(spec.spec_path)]
    module = "tuneloop.training.train"
    n = spec.num_processes
    if n == 1:
        return [sys.executable, "-u", "-m", module, *script]
    if spec.launcher == "deepspeed":
        # --num_gpus also sets the process count on CPU (without it: one per NUMA node).
        return [
            sys.executable,
            "-u",
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(n),
            "--master_port",
            str(port),
            "--module",
            module,
            *script,
        ]
    if spec.launcher == "torchrun":
        return [
            sys.executable,
            "-u",
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(n),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            module,
            *script,
        ]
    raise TrainingError(f"{spec.name}: unknown launcher {spec.launcher!r} (torchrun or deepspeed)")


def training_env(spec: TrainSpec, port: int) -> dict[str, str]:
    env = dict(os.environ)
    # The job must find this package even when it is not pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach on_log as they are printed
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.num_processes == 1:
        # Without a launcher DeepSpeed (and torch.distributed) read these or look for MPI.
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the launcher sets them per process
    return env


@dataclass
class TrainingJob:
    """A started job: the launcher process (leader of its own process group) and its port."""

    spec: TrainSpec
    proc: subprocess.Popen
    port: int

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the launcher and every rank still alive (SIGTERM, then SIGKILL); free shared memory."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # ranks the launcher left behind, if any
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.release_shared_memory()

    def release_shared_memory(self) -> None:
        """Delete the job's DeepSpeed shared-memory buffers.

        DeepSpeed's CPU all-reduce creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
        (66 MB each) and never unlinks them, even on success: without this every CPU job
        leaks 66 MB per rank of RAM-backed storage. The port makes the names this job's own.
        """
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{self.port}_*"):
            path.unlink(missing_ok=True)


def start_training(spec: TrainSpec) -> TrainingJob:
    """Write spec.json and start the job in its own process group; output is one text pipe."""
    spec.save()
    port = free_port()
    proc = subprocess.Popen(
        training_command(spec, port),
        env=training_env(spec, port),
        cwd=str(REPO_ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # one group: stopping the job stops every rank
    )
    return TrainingJob(spec=spec, proc=proc, port=port)


def launch_training(spec: TrainSpec, on_log: Callable[[str], None] = print) -> TrainResult:
    """Run spec to completion, streaming its log to on_log; resume if checkpoints exist."""
    job = start_training(spec)
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    on_log(f"[{spec.name}] {' '.join(job.proc.args)}")
    try:
        assert job.proc.stdout is not None
        # Text mode splits on \r too, so progress-bar redraws arrive as separate lines.
        for line in job.proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                on_log(line)
        code = job.proc.wait()
    finally:
        job.stop()  # a no-op after a normal exit, except freeing shared memory; on Ctrl-C or a
        # cancelled task it leaves no orphan ranks behind
    if code != 0:
        raise TrainingError(
            f"training {spec.name} failed with exit code {code} (output_dir {spec.output_dir}); "
            f"last {len(tail)} log lines:\n" + "\n".join(tail)
        )
    try:
        result = json.loads(spec.result_path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainingError(f"training {spec.name} exited 0 but {spec.result_path} is unreadable: {exc}") from None
    return TrainResult(model_dir=spec.model_dir, train_result=result, spec=spec)
