"""`tuneloop`: every stage of the loop as a command (each also a library function).

Heavy libraries (torch, transformers, Great Expectations, MLflow, Prefect) are imported
inside the commands that need them, so `tuneloop --help` answers at once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

# No model hub on this kind of machine; never wait on it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")

app = typer.Typer(
    help="tuneloop: fine-tune, evaluate, promote, serve and monitor an OpenAI-style model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
registry_app = typer.Typer(help="MLflow registry: promotion history and rollback.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")

console = Console()
err_console = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML config (default: configs/default.yaml).")


def _load(config: Optional[Path]):
    from components.config import ConfigError, load_config

    try:
        return load_config(config)
    except ConfigError as exc:
        _fail(str(exc))


def _fail(message: str, code: int = 2):
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@app.command("config")
def show_config(config: Optional[Path] = ConfigOption):
    """Print the resolved configuration (file + environment overrides + defaults)."""
    cfg = _load(config)
    console.print_json(cfg.model_dump_json())
    console.print(f"home: {cfg.home}\nmlflow: {cfg.mlflow_tracking_uri}\nbase model: {cfg.base_model_ref}")


@app.command()
def bootstrap(
    config: Optional[Path] = ConfigOption,
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching model is cached."),
):
    """Build the small local base model (tokenizer + GPT-2/Llama, briefly pre-trained). Cached."""
    cfg = _load(config)
    from components.bootstrap import bootstrap_base_model

    path = bootstrap_base_model(cfg.bootstrap, cfg.bootstrap_dir, force=force)
    console.print(f"[green]base model ready:[/] {path}")


def ensure_base_model(cfg) -> str:
    """The base model reference; builds the bootstrap model first when that is what's configured."""
    if cfg.model.base_model == "bootstrap":
        from components.bootstrap import bootstrap_base_model

        bootstrap_base_model(cfg.bootstrap, cfg.bootstrap_dir)
    return cfg.base_model_ref


def _prepare(cfg, data: Optional[Path], eval_data: Optional[Path]):
    from components.data.dataset import prepare_dataset
    from components.data.formats import DataError

    try:
        return prepare_dataset(cfg, train_path=data, eval_path=eval_data)
    except DataError as exc:
        _fail(str(exc), code=1)


@app.command()
def prepare(
    data: Optional[Path] = typer.Argument(None, help="Training file (default: data.train_path)."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Explicit eval file (default: split)."),
    config: Optional[Path] = ConfigOption,
):
    """Load, normalise and split a training set; write it under <home>/datasets/<fingerprint>."""
    cfg = _load(config)
    prepared = _prepare(cfg, data, eval_data)
    console.print(prepared.summary())


def _token_counter(cfg):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_base_model(cfg))
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def run_validation(cfg, prepared):
    """Validate a prepared dataset with the configured tokenizer; returns the report."""
    from components.validation import validate_dataset

    return validate_dataset(
        prepared.train, prepared.eval, cfg.validation, _token_counter(cfg), cfg.data_docs_dir
    )


@app.command()
def validate(
    data: Optional[Path] = typer.Argument(None, help="Training file (default: data.train_path)."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Explicit eval file (default: split)."),
    config: Optional[Path] = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Run the Great Expectations gate. Exit 0 on pass, 1 on fail."""
    cfg = _load(config)
    prepared = _prepare(cfg, data, eval_data)
    report = run_validation(cfg, prepared)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        console.print(prepared.summary())
        console.print(report.summary())
        console.print(f"Data Docs: {report.data_docs_path}")
    raise typer.Exit(0 if report.success else 1)


@app.command()
def demo(config: Optional[Path] = ConfigOption):
    """The main job on embedded defaults: bootstrap the base model, load + validate + split the sample set."""
    cfg = _load(config)
    console.rule("1. base model")
    console.print(f"base model: {ensure_base_model(cfg)}")
    console.rule("2. data")
    prepared = _prepare(cfg, None, None)
    console.print(prepared.summary())
    console.rule("3. validation gate")
    report = run_validation(cfg, prepared)
    console.print(report.summary())
    console.print(f"Data Docs: {report.data_docs_path}")
    if not report.success:
        _fail("validation failed; nothing was trained", code=1)
    console.print("[bold green]demo complete[/]")


def main():  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
