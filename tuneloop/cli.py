"""`tuneloop`: every stage of the loop as a command (each also a library function).

One file on purpose: every command, sub-command and option of `tuneloop` in one place, each
a thin wrapper that loads the config, calls a library function and prints its result.

Heavy libraries (torch, transformers, Great Expectations, MLflow, Prefect) are imported
inside the commands that need them, so `tuneloop --help` answers at once; so are the project
modules that import tuneloop.config (its pydantic and yaml take 0.17 s, as long as the rest
of `--help`), each such line saying so.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from tuneloop.data.formats import DataError
from tuneloop.gate_report import REPORT_NAME
from tuneloop.presets import PRESETS, convert_preset
from tuneloop.requestlog.feedback import export_feedback_dataset, export_preference_dataset
from tuneloop.requestlog.store import LogError, describe, parse_since, read_records, write_export

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
filter_app = typer.Typer(help="The content filter's classifier: train, evaluate, bless, promote.", no_args_is_help=True)
app.add_typer(filter_app, name="filter")
logs_app = typer.Typer(help="The request log: every finished /v1 request, redacted; feedback.", no_args_is_help=True)
app.add_typer(logs_app, name="logs")
keys_app = typer.Typer(help="API keys of the gateway: create (shown once), list, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # error lines stay whole (file:line: reason)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML config (default: configs/default.yaml).")


def _load(config: Optional[Path]):
    from tuneloop.config import ConfigError, load_config  # deferred: tuneloop.config's pydantic (0.17 s)

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
    """Build the small local base model (tokenizer + GPT-2/Llama, briefly pre-trained), or convert
    the configured preset (model.base_model: smollm2-135m-instruct) into an HF folder. Cached."""
    cfg = _load(config)
    from tuneloop.bootstrap import BootstrapError, bootstrap_base_model  # deferred: tuneloop.config's pydantic (0.17 s)

    try:
        if cfg.model.base_model in PRESETS:
            path = convert_preset(cfg.model.base_model, Path(cfg.base_model_ref), force=force)
        else:
            path = bootstrap_base_model(cfg.bootstrap, cfg.bootstrap_dir, force=force)
    except BootstrapError as exc:
        _fail(str(exc))
    console.print(f"[green]base model ready:[/] {path}")


def ensure_base_model(cfg) -> str:
    from tuneloop.bootstrap import BootstrapError  # deferred: tuneloop.config's pydantic (0.17 s)
    from tuneloop.bootstrap import ensure_base_model as ensure  # deferred: tuneloop.config's pydantic (0.17 s)

    try:
        return ensure(cfg)
    except (BootstrapError, FileNotFoundError) as exc:
        _fail(str(exc))


def _prepare(cfg, data: Optional[Path], eval_data: Optional[Path]):
    from tuneloop.data.dataset import prepare_dataset  # deferred: tuneloop.config's pydantic (0.17 s)

    budget = None
    if cfg.validation.overlong != "fail":  # over-long rows are measured in the base model's tokens
        from tuneloop.validation import token_budget  # deferred: tuneloop.config's pydantic (0.17 s)

        ensure_base_model(cfg)
        budget = token_budget(cfg)
    try:
        return prepare_dataset(cfg, train_path=data, eval_path=eval_data, budget=budget)
    except DataError as exc:
        _fail(str(exc), code=1)


@app.command()
def prepare(
    data: Optional[Path] = typer.Argument(None, help="Training file (default: data.train_path)."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Explicit eval file (default: split)."),
    config: Optional[Path] = ConfigOption,
):
    """Load, normalise, apply the row policies (over-long rows, personal data) and split a
    training set; write it under <home>/datasets/<fingerprint>."""
    cfg = _load(config)
    prepared = _prepare(cfg, data, eval_data)
    console.print(prepared.summary())


def run_validation(cfg, prepared):
    """Validate a prepared dataset with the configured tokenizer; returns the report."""
    from tuneloop.validation import validate_prepared  # deferred: tuneloop.config's pydantic (0.17 s)

    ensure_base_model(cfg)
    return validate_prepared(cfg, prepared)


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
    raise typer.Exit(0 if report.success else 1)


@app.command()
def demo(
    config: Optional[Path] = ConfigOption,
    loop: bool = typer.Option(
        True,
        "--loop/--no-loop",
        help="After the first training, run the closed loop (serve, drift, retrain, redeploy).",
    ),
):
    """The main job on embedded defaults: base model, data gate, training flow, content filter,
    then the closed loop against a served champion.

    The training flow fine-tunes, evaluates, blesses, promotes, packages and infra-validates
    the champion; the content filter's flow trains on the labelled set the project ships; the loop
    (tuneloop/demo.py) serves the champion, sends traffic, monitors, retrains on drift and
    moves the running server to the new champion."""
    started = time.time()
    cfg = _load(config)
    console.rule("1. base model")
    console.print(f"base model: {ensure_base_model(cfg)}")
    console.rule("2. data and validation gate")
    prepared = _prepare(cfg, None, None)
    console.print(prepared.summary())
    report = run_validation(cfg, prepared)
    console.print(report.summary())
    if not report.success:
        _fail("validation failed; nothing was trained", code=1)
    console.rule("3. training flow")
    train(config=config, data=None, eval_data=None, as_json=False)
    console.rule("4. content filter (the gateway's classifier)")
    try:
        filter_train(config=config, data=None, eval_data=None, as_json=False)
    except typer.Exit as exc:  # not blessed: the gateway keeps its rules (and any earlier champion)
        if exc.exit_code:
            console.print("[yellow]the classifier was not blessed; the filter keeps what it had[/]")
    loop_out = _run_loop(cfg, config, "auto") if loop else None
    _print_next(cfg, loop_out, time.time() - started)


def _run_loop(cfg, config: Optional[Path], retrain: str, quiet: bool = False, requests: int | None = None) -> dict:
    from tuneloop.demo import CALM_REQUESTS, run_loop  # deferred: httpx and tuneloop.config's pydantic (0.28 s)

    _use_prefect(cfg)
    out = console if not quiet else err_console
    out.rule("5. the loop: serve -> traffic -> drift -> retrain -> redeploy")
    try:
        loop_out = run_loop(
            cfg,
            str(config) if config else None,
            say=out.print,
            rule=out.rule,
            retrain=retrain,
            requests=requests or CALM_REQUESTS,
        )
    except Exception as exc:  # noqa: BLE001 - the demo says what failed and where its logs are
        _fail(f"the loop stopped: {type(exc).__name__}: {exc}", code=1)
    if loop_out["stream_failures"]:
        out.print(
            f"[red]{len(loop_out['stream_failures'])} of {loop_out['streams']} streams failed:[/] "
            f"{loop_out['stream_failures'][:3]}"
        )
    else:
        out.print(
            f"a client streamed throughout: {loop_out['streams']} streams, no error, "
            f"served by {', '.join(loop_out['streamed_versions'])}"
        )
    if loop_out.get("filter_refusals"):
        refused = loop_out["filter_refusals"]
        out.print(
            f"[yellow]the content filter refused {len(refused)} of the loop's prompts[/] (ordinary ones: "
            f"false positives; gateway.filter.classifier_action: annotate counts them instead), e.g. "
            f"{refused[0][:120]!r}"
        )
    return loop_out


@app.command()
def loop(
    config: Optional[Path] = ConfigOption,
    retrain: str = typer.Option(
        "auto",
        "--retrain",
        help="flow: run the triggered training flow here; trigger: "
        "wait for the training deployment's trigger (a Prefect "
        "server and worker); auto: trigger when prefect.api_url is set.",
    ),
    requests: int = typer.Option(
        60,
        "--requests",
        min=1,
        help="Requests of each kind (like the training data, shifted); a window needs monitoring.drift.min_requests.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print what happened as JSON (progress goes to stderr)."),
):
    """The closed loop against the current champion (the demo's step 5): serve it, send traffic like
    the training data, then shifted traffic and feedback, monitor, retrain on drift, and move the
    running server to the new champion while a client streams."""
    cfg = _load(config)
    if retrain not in ("auto", "flow", "trigger"):
        _fail(f"--retrain must be auto, flow or trigger, got {retrain!r}")
    from tuneloop.registry import ModelRegistry  # deferred: tuneloop.config's pydantic (0.17 s)

    if ModelRegistry.from_config(cfg).champion() is None:
        _fail("there is no champion to serve yet: run `tuneloop train` (or `tuneloop demo`) first", code=1)
    loop_out = _run_loop(cfg, config, retrain, quiet=as_json, requests=requests)
    if as_json:
        print(json.dumps({k: v for k, v in loop_out.items() if k != "key"}, indent=2, default=str))
    else:
        _print_next(cfg, loop_out, None)
    raise typer.Exit(1 if loop_out["stream_failures"] else 0)


def _print_next(cfg, loop_out: dict | None, seconds: float | None) -> None:
    """Where a person looks after the demo."""
    console.rule("where to look" + (f" (demo took {seconds / 60:.1f} min)" if seconds else ""))
    docs = cfg.data_docs_dir / REPORT_NAME
    lines = [
        f"MLflow UI:     .venv/bin/mlflow ui --backend-store-uri {cfg.mlflow_tracking_uri}   -> http://127.0.0.1:5000",
        "               (experiments: training runs, tuneloop-monitoring with the drift report, the filter)",
        "Prefect UI:    .venv/bin/prefect server start   -> http://127.0.0.1:4200  (the demo's flow runs and "
        "artifacts are in its database)",
        f"data gate:     {docs}   (GX Data Docs beside it: index.html)",
    ]
    if loop_out and loop_out.get("report"):
        lines.append(f"drift report:  {loop_out['report']}")
    lines.append("promotions:    .venv/bin/tuneloop registry history")
    key = loop_out["key"] if loop_out else "<a key from: .venv/bin/tuneloop keys create --name me --tier paid>"
    if loop_out:
        lines.append(
            f"API key:       {key}   (created for the demo, shown once; "
            f"revoke: .venv/bin/tuneloop keys revoke {loop_out['key_id']})"
        )
    lines += [
        "serve:         .venv/bin/tuneloop serve   -> http://127.0.0.1:3000/v1, then:",
        f"""  .venv/bin/python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:3000/v1', api_key='{key}'); """
        f"""print(c.chat.completions.create(model='{(loop_out or {}).get("model", cfg.mlflow.registered_model)}', messages=[{{'role': 'user', 'content': 'What is 2 + 4?'}}]).choices[0].message.content)" """,
    ]
    console.print("\n".join(lines), highlight=False, soft_wrap=True)
    console.print("[bold green]demo complete[/]")


@app.command()
def train(
    config: Optional[Path] = ConfigOption,
    data: Optional[Path] = typer.Option(None, "--data", help="Training file (default: data.train_path)."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Explicit eval file (default: split)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Run the training flow: validate, fine-tune candidates, evaluate, bless, promote."""
    cfg = _load(config)
    _use_prefect(cfg)
    from flows.tasks import ValidationFailed
    from flows.training import training_flow
    from tuneloop.bootstrap import BootstrapError  # deferred: tuneloop.config's pydantic (0.17 s)
    from tuneloop.config import ConfigError  # deferred: tuneloop.config's pydantic (0.17 s)
    from tuneloop.training.launch import TrainingError  # deferred: tuneloop.config's pydantic (0.17 s)

    try:
        summary = training_flow(
            config_path=str(config) if config else None,
            data=str(data) if data else None,
            eval_data=str(eval_data) if eval_data else None,
        )
    except ValidationFailed as exc:
        _fail(f"validation failed; nothing was trained or promoted\n{exc}", code=1)
    except (DataError, ConfigError, BootstrapError) as exc:
        _fail(f"{exc}\nnothing was trained or promoted", code=1)
    except TrainingError as exc:
        _fail(f"training failed; nothing was promoted\n{exc}", code=1)
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_training_summary(summary)


@filter_app.command("train")
def filter_train(
    config: Optional[Path] = ConfigOption,
    data: Optional[Path] = typer.Option(
        None,
        "--data",
        help="Labelled set with columns text, label "
        "(default: gateway.filter_training.train_path, the "
        "set generated into data/injections).",
    ),
    eval_data: Optional[Path] = typer.Option(
        None,
        "--eval-data",
        help="A real labelled set (text, label) to score the trained classifier on; never trained on.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Run the filter-training flow: train the prompt-injection classifier, compare it with the
    baseline and the champion, bless it, promote it (servers load it by alias at start-up)."""
    cfg = _load(config)
    _use_prefect(cfg)
    from flows.filter import filter_training_flow

    try:
        summary = filter_training_flow(
            config_path=str(config) if config else None,
            data=str(data) if data else None,
            eval_data=str(eval_data) if eval_data else None,
        )
    except (FileNotFoundError, ValueError) as exc:
        _fail(f"{exc}\nnothing was trained or promoted", code=1)
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    m, b = summary["metrics"], summary["baseline"]
    console.print(
        f"{summary['method']}: recall {m['recall']:.3f} at FPR {m['fpr']:.3f}, ROC-AUC {m['roc_auc']:.3f} "
        f"(baseline: recall {b['recall']:.3f} at FPR {b['fpr']:.3f}, ROC-AUC {b['roc_auc']:.3f})"
    )
    if summary.get("external"):
        e = summary["external"]
        console.print(
            f"on {summary['external_path']} (never trained on): recall {e['recall']:.3f} at FPR "
            f"{e['fpr']:.3f}, precision {e['precision']:.3f}, ROC-AUC {e['roc_auc']:.3f}"
        )
    state = "[green]blessed[/]" if summary["blessed"] else "[red]not blessed[/]"
    console.print(
        f"{summary['registered_model']} version {summary['version']}: {state} "
        f"({'; '.join(summary['reasons'])}); champion: {summary['champion_after']}"
    )
    if not summary["blessed"]:
        raise typer.Exit(1)


@app.command()
def monitor(
    since: Optional[str] = typer.Option(
        None, "--since", help="Window start: 15m, 2h, 7d or an ISO time (default: monitoring.window back from now)."
    ),
    until: Optional[str] = typer.Option(None, "--until", help="Window end (default: now)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    config: Optional[Path] = ConfigOption,
):
    """Run the monitoring flow once, now: drift against the champion's training prompts and
    service health against the SLOs; emits tuneloop.retrain.requested / tuneloop.slo.breached."""
    cfg = _load(config)
    try:
        parse_since(since), parse_since(until)
    except LogError as exc:
        _fail(str(exc))
    _use_prefect(cfg)
    from flows.monitoring import monitoring_flow

    result = monitoring_flow(config_path=str(config) if config else None, since=since, until=until)
    events = [e["event"] for e in result["events"]]
    if as_json:
        print(json.dumps({**result, "events": events, "event_payloads": result["events"]}, indent=2, default=str))
        return
    d, s = result["drift"], result["slo"]
    w = result["window"]
    console.print(f"{w['requests']} logged requests, {w['prompts']} prompts, {w['since']} → {w['until']}")
    verdict = (
        ("[red]drift detected[/]" if d["detected"] else "[green]no drift[/]")
        if d["judged"]
        else f"[yellow]drift not judged[/]: {d['reason']}"
    )
    console.print(f"{verdict}  " + "  ".join(f"{k} {v}" for k, v in d["scores"].items()))
    verdict = (
        (f"[red]SLO breached[/]: {', '.join(s['breached'])}" if s["breached"] else "[green]within SLOs[/]")
        if s["judged"]
        else f"[yellow]SLOs not judged[/]: {s['reason']}"
    )
    console.print(f"{verdict}  " + "  ".join(f"{k} {v}" for k, v in s["values"].items() if v is not None))
    console.print(
        f"events: {', '.join(events) or 'none'}; report: {result['report'] or '-'}; summary: {result['dir']}/summary.md"
    )


def _use_prefect(cfg) -> None:
    """Point Prefect at the configured server; none configured means an ephemeral one."""
    if cfg.prefect.api_url:
        os.environ["PREFECT_API_URL"] = cfg.prefect.api_url
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Offline by design: the server's telemetry reaches nowhere, and its session row raced the
    # flow's own writes on the ephemeral SQLite database (a `database is locked` traceback in
    # `make demo`). A user who wants it sets the variable.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _print_training_summary(summary: dict) -> None:
    ch = summary["challenger"]
    table = Table(title=f"challenger {ch['name']} -> version {ch['version']}")
    table.add_column("metric")
    table.add_column("challenger", justify="right")
    table.add_column("base", justify="right")
    for key, value in ch["metrics"].items():
        if "/" in key:  # per template / label / suite: in the report
            continue
        base = summary["base"].get(key)
        table.add_row(key, f"{value:.4f}", f"{base:.4f}" if base is not None else "-")
    console.print(table)
    for skip in summary.get("behaviour_skipped") or []:
        console.print(f"behaviour suite {skip['suite']} skipped: {skip['reason']}")
    wrong = summary.get("wrong_answers") or []
    if wrong:
        console.print(f"first wrong answers of {ch['name']} (all rows: {summary.get('report', 'the run report')}):")
        for row in wrong:
            console.print(f"  {row['id']}: expected {row['expected']!r}, got {row['generated']!r}", markup=False)
    for note in summary.get("recipe_notes") or []:
        console.print(f"recipe: {note}", markup=False)
    verdict = "[green]BLESSED[/]" if summary["blessed"] else "[yellow]not blessed[/]"
    console.print(f"decision: {verdict}")
    for reason in summary["reasons"]:
        console.print(f"  - {reason}")
    promoted = "promoted" if summary["promoted"] else "not promoted"
    console.print(
        f"champion: {summary['champion_before'] or 'none'} -> {summary['champion_after'] or 'none'} ({promoted})"
    )
    if summary.get("promotion_refused"):
        console.print(f"[yellow]promotion refused:[/] {summary['promotion_refused']}")
    deployment = summary.get("deployment")
    if deployment:
        if deployment["deployed"]:
            console.print(f"deployed: bento {deployment['bento_tag']} (built, served and answered in infra validation)")
        else:
            console.print(
                f"[red]not deployed:[/] {deployment['reason']} (still deployed: {deployment['previous_bento'] or 'none'})"
            )


def _registry(cfg):
    from tuneloop.registry import ModelRegistry  # deferred: tuneloop.config's pydantic (0.17 s)
    from tuneloop.tracking import setup_mlflow  # deferred: tuneloop.config's pydantic (0.17 s)

    setup_mlflow(cfg)
    return ModelRegistry(cfg.mlflow_tracking_uri, cfg.mlflow.registered_model)


@registry_app.command("history")
def registry_history(config: Optional[Path] = ConfigOption, as_json: bool = typer.Option(False, "--json")):
    """Who/what/when/why of every promotion and rollback."""
    records = [r.to_dict() for r in _registry(_load(config)).history()]
    if as_json:
        print(json.dumps(records, indent=2, default=str))
        return
    table = Table(title="promotions")
    for col in ("when", "action", "from", "to", "who", "why"):
        table.add_column(col)
    for r in records:
        table.add_row(
            str(r.get("at", "")),
            str(r.get("action", "")),
            str(r.get("from_version") or "-"),
            str(r.get("to_version", "")),
            str(r.get("actor", "")),
            str(r.get("reason", "")),
        )
    console.print(table if records else "no promotions yet")


@registry_app.command("rollback")
def registry_rollback(
    config: Optional[Path] = ConfigOption,
    reason: str = typer.Option("manual rollback", "--reason", help="Recorded in the history."),
):
    """Make `previous` the champion again (the current champion becomes `previous`)."""
    from tuneloop.registry import RegistryError  # deferred: tuneloop.config's pydantic (0.17 s)

    try:
        result = _registry(_load(config)).rollback(reason=reason, actor=getpass.getuser())
    except RegistryError as exc:
        _fail(str(exc), code=1)
    console.print(f"[green]rolled back:[/] champion is now version {result.version} (was {result.previous})")


def _key_store(cfg):
    from tuneloop.gateway.pipeline import open_key_store

    return open_key_store(cfg)


def _key_row(k) -> dict:
    return {
        "id": k.id,
        "name": k.name,
        "tier": k.tier,
        "team": k.team,
        "status": k.status(),
        "created_at": k.created_at.isoformat(timespec="seconds"),
        "expires_at": k.expires_at.isoformat(timespec="seconds") if k.expires_at else None,
        "requests_per_minute": k.requests_per_minute,
        "tokens_per_minute": k.tokens_per_minute,
    }


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., "--name", help="Who or what the key is for."),
    tier: str = typer.Option("free", "--tier", help="A tier of gateway.tiers (free, paid, enterprise by default)."),
    expires: Optional[str] = typer.Option(None, "--expires", help="A duration (30m, 12h, 90d, 4w) or an ISO date."),
    team: Optional[str] = typer.Option(
        None, "--team", help="Keys of one team share cached answers (with gateway.cache.scope: team)."
    ),
    rpm: Optional[int] = typer.Option(None, "--rpm", help="Override the tier's requests per minute."),
    tpm: Optional[int] = typer.Option(None, "--tpm", help="Override the tier's tokens per minute."),
    as_json: bool = typer.Option(False, "--json"),
    config: Optional[Path] = ConfigOption,
):
    """Create a key. The key is printed once and stored only as a peppered hash."""
    from tuneloop.gateway.keys import KeyStoreError, parse_expiry

    cfg = _load(config)
    try:
        record, secret = _key_store(cfg).create(name, tier, parse_expiry(expires), team, rpm, tpm)
    except KeyStoreError as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps({**_key_row(record), "key": secret}))
        return
    console.print(
        f"created key {record.id} ({record.name}, tier {record.tier}"
        f"{', expires ' + record.expires_at.isoformat(timespec='seconds') if record.expires_at else ''})"
    )
    console.print("the key (shown once, not stored; keep it secret):")
    print(secret)


@keys_app.command("list")
def keys_list(config: Optional[Path] = ConfigOption, as_json: bool = typer.Option(False, "--json")):
    """Every key's id, name, tier and status (never the keys themselves)."""
    rows = [_key_row(k) for k in _key_store(_load(config)).list()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="API keys")
    for col in ("id", "name", "tier", "team", "status", "created_at", "expires_at"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[c] or "-") for c in ("id", "name", "tier", "team", "status", "created_at", "expires_at")))
    console.print(table if rows else "no keys yet: tuneloop keys create --name NAME --tier free")


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="The key's id (tuneloop keys list)."), config: Optional[Path] = ConfigOption
):
    """Revoke a key: refused from the next request on, on every replica."""
    from tuneloop.gateway.keys import KeyStoreError

    try:
        record = _key_store(_load(config)).revoke(key_id)
    except KeyStoreError as exc:
        _fail(str(exc), code=1)
    console.print(f"revoked key {record.id} ({record.name})")


def _log_records(cfg, stream: str, since: Optional[str], until: Optional[str] = None) -> list[dict]:
    try:
        return read_records(cfg.request_log.url, cfg.home, stream, parse_since(since), parse_since(until))
    except LogError as exc:
        _fail(str(exc))


StreamOption = typer.Option("requests", "--stream", help="requests or feedback.")


@logs_app.command("tail")
def logs_tail(
    n: int = typer.Option(20, "-n", "--lines", help="How many of the latest records."),
    since: Optional[str] = typer.Option(None, "--since", help="Only after this: 15m, 2h, 7d or an ISO time."),
    stream: str = StreamOption,
    as_json: bool = typer.Option(False, "--json", help="One JSON record per line."),
    config: Optional[Path] = ConfigOption,
):
    """The latest logged requests (or feedback), oldest first."""
    cfg = _load(config)
    records = _log_records(cfg, stream, since)[-n:] if n > 0 else []
    if as_json:
        for r in records:
            typer.echo(json.dumps(r, ensure_ascii=False))
        return
    if stream == "feedback":
        table = Table(title=f"feedback ({len(records)})")
        for col in ("time", "request", "key", "rating", "correction"):
            table.add_column(col)
        for r in records:
            table.add_row(
                r.get("time", ""),
                r.get("request_id", ""),
                r.get("key_id") or "-",
                str(r.get("rating")),
                _short(r.get("correction")),
            )
    else:
        table = Table(title=f"requests ({len(records)})")
        for col in ("time", "request", "route", "status", "key", "model", "tokens", "ttft", "latency", "cache"):
            table.add_column(col)
        for r in records:
            status = str(r.get("status")) + (f" {r['error_code']}" if r.get("error_code") else "")
            tokens = (
                f"{r.get('prompt_tokens') or 0}+{r.get('completion_tokens') or 0}" if r.get("prompt_tokens") else "-"
            )
            table.add_row(
                r.get("time", ""),
                r.get("request_id", ""),
                r.get("route", ""),
                status,
                r.get("key_id") or "-",
                f"{r.get('model') or '-'}:{r.get('model_version') or '-'}",
                tokens,
                _secs(r.get("ttft_s")),
                _secs(r.get("latency_s")),
                r.get("cache") or "-",
            )
    console.print(table if records else f"no {stream} logged yet (request log: {_log_location(cfg)})")


def _short(text, n: int = 40) -> str:
    if text is None:
        return "-"
    return text if len(text) <= n else text[: n - 1] + "…"


def _secs(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _log_location(cfg) -> str:
    return describe(cfg.request_log.url, cfg.home)


@logs_app.command("export")
def logs_export(
    since: Optional[str] = typer.Option(None, "--since", help="From: 15m, 2h, 7d or an ISO time (default: all)."),
    until: Optional[str] = typer.Option(None, "--until", help="Up to (not including): a duration back or ISO time."),
    stream: str = StreamOption,
    fmt: str = typer.Option("jsonl", "--format", help="jsonl, csv or parquet."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="File to write (jsonl: default stdout)."),
    config: Optional[Path] = ConfigOption,
):
    """Logged requests (or feedback) of a time window, for people and notebooks."""
    cfg = _load(config)
    records = _log_records(cfg, stream, since, until)
    try:
        n = write_export(records, output, fmt)
    except LogError as exc:
        _fail(str(exc))
    if output is not None:
        typer.echo(f"{n} {stream} records -> {output}", err=True)


@logs_app.command("feedback-data")
def logs_feedback_data(
    output: Path = typer.Option(..., "--output", "-o", help="JSONL file of candidate training rows."),
    since: Optional[str] = typer.Option(None, "--since", help="Feedback given since: 15m, 2h, 7d or an ISO time."),
    validate: bool = typer.Option(False, "--validate", help="Run the rows through the training data gate."),
    preferences: bool = typer.Option(
        False, "--preferences", help="Preference pairs (OpenAI's DPO format) from preferences, corrections, ratings."
    ),
    config: Optional[Path] = ConfigOption,
):
    """Corrected completions from feedback as training rows (the training set's format), with
    lineage; --preferences: the feedback's preference pairs, for preference tuning (DPO)."""
    cfg = _load(config)
    try:
        export = export_preference_dataset if preferences else export_feedback_dataset
        lineage = export(cfg, output, parse_since(since))
    except LogError as exc:
        _fail(str(exc))
    rejected = ", ".join(f"{n} {why}" for why, n in lineage["rejected"].items()) or "none"
    typer.echo(f"{lineage['rows']} candidate rows -> {output} (lineage: {output}.lineage.json; left out: {rejected})")
    if validate and lineage["rows"]:
        report = run_validation(cfg, _prepare(cfg, output, None))
        console.print(report.summary())
        raise typer.Exit(0 if report.success else 1)


@app.command()
def package(
    config: Optional[Path] = ConfigOption,
    version: Optional[str] = typer.Option(
        None, "--version", help="Registry version, or with --target gguf an ft: model id (default: the champion)."
    ),
    target: Optional[str] = typer.Option(
        None, "--target", help="cpu or gpu: a bento image (default: bento.target); gguf: one GGUF file for llama.cpp."
    ),
    quant: Optional[str] = typer.Option(
        None, "--quant", help="--target gguf: f32 (default), bf16, q8_0 or q4_k_m (docs/gguf.md)."
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", help="--target gguf: a .gguf file, or a folder, to write (default: <home>/gguf/)."
    ),
    check: bool = typer.Option(
        True, "--check/--no-check", help="--target gguf: compare llama-server's answers with the served model's."
    ),
    artifact: bool = typer.Option(
        True, "--artifact/--no-artifact", help="--target gguf: log the file to the version's MLflow run."
    ),
):
    """Package the champion as a bento, infra-validate it with `bentoml serve`, mark it deployed;
    or (--target gguf) export it as a GGUF file, checked against the served model's answers."""
    cfg = _load(config)
    from tuneloop.packaging.common import PackagingError

    if target == "gguf":
        from tuneloop.packaging.gguf import export_gguf

        try:
            exported = export_gguf(
                cfg,
                quant or "f32",
                version,
                output,
                check,
                artifact,
                progress=lambda m: console.print(m, markup=False, highlight=False, soft_wrap=True),
            )
        except PackagingError as exc:
            _fail(str(exc), code=1)
        console.print(exported.summary(), markup=False, highlight=False, soft_wrap=True)  # paths and commands whole
        if exported.warning:
            err_console.print(f"[bold yellow]warning:[/] {exported.warning}", highlight=False)
        return
    gguf_only = [flag for flag, given in (("--quant", quant), ("--output", output)) if given is not None]
    if gguf_only or not check or not artifact:
        _fail(f"{', '.join(gguf_only) or '--no-check/--no-artifact'}: only with --target gguf")
    from tuneloop.packaging.bento import containerize_command
    from tuneloop.packaging.deployment import deploy_champion

    try:
        result = deploy_champion(cfg, version=version, target=target, progress=console.print)
    except PackagingError as exc:
        _fail(str(exc), code=1)
    console.print(result.summary())
    if not result.deployed:
        raise typer.Exit(1)
    console.print(f"container image (needs Docker): {containerize_command(cfg, result.bento_tag)}")


@app.command()
def serve(
    config: Optional[Path] = ConfigOption,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(3000, "--port"),
):
    """Serve the deployed bento (else the champion, else bentos/ as configured) with `bentoml serve`."""
    cfg = _load(config)
    from tuneloop.packaging.common import PackagingError
    from tuneloop.packaging.deployment import serve_plan
    from tuneloop.packaging.server import run_server

    if cfg.model.base_model in PRESETS and cfg.serving.model_dir is None:
        ensure_base_model(cfg)  # converted once; served when there is no champion yet

    try:
        plan = serve_plan(cfg, host, port)
    except PackagingError as exc:
        _fail(str(exc), code=1)
    console.print(plan.what)
    outcome = run_server(plan, host, port)
    if outcome.failure:
        _fail(f"the server could not start: {outcome.failure}", code=1)
    raise typer.Exit(outcome.exit_code)


@app.command()
def agreement(
    config: Optional[Path] = ConfigOption,
    model_dir: Optional[Path] = typer.Option(
        None, "--model-dir", help="A Hugging Face model folder (default: the one `tuneloop serve` would serve)."
    ),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="serving.dtype to check (default: as configured)."),
    forward: Optional[str] = typer.Option(None, "--forward", help="serving.forward to check: fused or transformers."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Does the served configuration give the reference's answers? Greedy answers on the committed
    prompts and next-token agreement on the committed text, against transformers' float32 forward
    of the same model (tuneloop/serving/agreement.py). Exit 0 when it passes the bar, 1 when not."""
    cfg = _load(config)
    from tuneloop.serving.agreement import check  # deferred: tuneloop.config's pydantic (0.17 s)
    from tuneloop.serving.setup import resolve_model_dir  # deferred: tuneloop.config's pydantic (0.17 s)

    if model_dir is None and cfg.model.base_model != "bootstrap":
        ensure_base_model(cfg)
    folder = model_dir or resolve_model_dir(cfg)
    updates = {k: v for k, v in (("dtype", dtype), ("forward", forward)) if v is not None}
    try:
        serving = cfg.serving.model_validate({**cfg.serving.model_dump(), **updates})
    except ValueError as exc:
        _fail(str(exc))
    report = check(folder, serving)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.print(f"{report.label} on {folder}: {report.line()}")
        for a in report.answers:
            if not a["equal"]:
                console.print(
                    f"  {a['id']}: reference {a['reference'][:60]!r}\n       served    {a['candidate'][:60]!r}"
                )
    raise typer.Exit(0 if report.passes else 1)


def main():  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
