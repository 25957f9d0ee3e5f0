"""The content filter's classifier as the gateway finds it in the registry: which version
gateway.filter.classifier names, its folder (downloaded once), and the filter built from the
rules and that classifier (loaded here, or scored in the checks' process)."""

from __future__ import annotations

import logging
from pathlib import Path

from tuneloop.gateway.content_filter import ContentFilter, RuleSet
from tuneloop.registry import ModelRegistry
from tuneloop.serving.errors import ServingSetupError

log = logging.getLogger("bentoml.tuneloop.gateway")


def registered_classifier(cfg, load: bool = True) -> tuple[Path | None, str | None]:
    """(its folder, "name:version") of the classifier gateway.filter.classifier names, when the
    filter is on and it is registered; (None, None) otherwise (rules only, with a warning, or
    ServingSetupError with on_missing_classifier: fail)."""
    f = cfg.gateway.filter
    if (f.prompts == "off" and f.outputs == "off") or not f.classifier or not load:
        return None, None
    folder, model_id = registered_classifier_folder(cfg, f.classifier)
    if folder is None:
        if f.on_missing_classifier == "fail":
            raise ServingSetupError(
                f"gateway.filter.classifier {f.classifier!r} is not registered; train it with `tuneloop filter train`"
            )
        log.warning(
            "content filter: %s is not registered (train it with `tuneloop filter train`); rules only", f.classifier
        )
    return folder, model_id


def build_content_filter(cfg, metrics=None, classifier: tuple | None = None, guard=None) -> ContentFilter | None:
    """Rules, plus the registered classifier (registered_classifier's (folder, model id); None:
    looked up here): loaded in this process, or scored in `guard`'s process."""
    f = cfg.gateway.filter
    if f.prompts == "off" and f.outputs == "off":
        return None
    rules = RuleSet(f.rules, f.rules_version)
    folder, model_id = classifier if classifier is not None else registered_classifier(cfg)
    clf = None
    if folder is not None:
        from tuneloop.gateway.filter_model import InjectionClassifier, RemoteClassifier

        clf = RemoteClassifier(folder, guard, f.timeout_s) if guard is not None else InjectionClassifier.load(folder)
    on_batch = on_texts = on_cpu = None
    if metrics is not None and guard is None:  # in a process, the child's CPU comes through guard.on_cpu
        on_cpu = metrics.cpu.labels(part="filter").inc
    if metrics is not None:

        def on_batch(n: int) -> None:
            metrics.filter_batch.observe(n)

        def on_texts(screened: int, encoded: int) -> None:
            metrics.filter_texts.labels(stage="screened").inc(screened)
            metrics.filter_texts.labels(stage="encoded").inc(encoded)

    return ContentFilter(
        rules,
        clf,
        f.threshold,
        model_id,
        f.max_batch_size,
        f.max_latency_ms,
        f.timeout_s,
        on_batch=on_batch,
        on_texts=on_texts,
        on_cpu=on_cpu,
    )


def load_registered_classifier(cfg, ref: str):
    """(InjectionClassifier, "name:version") for "name@alias" (or "name:version"); (None, None) if absent."""
    folder, model_id = registered_classifier_folder(cfg, ref)
    if folder is None:
        return None, None
    from tuneloop.gateway.filter_model import InjectionClassifier

    return InjectionClassifier.load(folder), model_id


def registered_classifier_folder(cfg, ref: str) -> tuple[Path | None, str | None]:
    """(the local folder of "name@alias" or "name:version", downloaded once, "name:version");
    (None, None) if it is not registered."""
    name, sep, alias = ref.partition("@")
    version = None
    if not sep:
        name, _, version = ref.partition(":")
    registry = ModelRegistry(cfg.mlflow_tracking_uri, name)
    info = registry.version(version) if version else registry.by_alias(alias)
    if info is None:
        return None, None
    folder = cfg.home / "gateway" / "filter" / f"{name}-{info.version}"
    if not (folder / "classifier.json").exists():
        tmp = folder.with_name(f".{folder.name}.{id(folder)}")
        registry.download(info.version, tmp)
        found = next(tmp.rglob("classifier.json"), None)
        if found is None:
            raise ValueError(f"{name} version {info.version} has no classifier.json")
        if not folder.exists():
            found.parent.rename(folder)
    log.info("content filter: classifier %s:%s (%s)", name, info.version, ref)
    return folder, f"{name}:{info.version}"
