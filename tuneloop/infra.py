"""Deploy manifests (infra/): render the Kubernetes kustomizations and validate what they produce.

    render_kustomization("infra/k8s/overlays/gpu")  -> list of manifests (dicts), as `kubectl kustomize`
    validate_manifest(doc)                          -> list of error strings (empty: valid)

The renderer implements the part of kustomize (v5) that infra/k8s uses, so the manifests are
checked on machines without kubectl: resources (files and directories), namespace, labels
(pairs only), images, patches (strategic merge, by the patch's own kind/name or a target;
JSON 6902 add/remove/replace), configMapGenerator (files, literals) with name hashes off. Any
other kustomization key is an error, never silently skipped. Where kubectl is installed,
tests/unit/test_infra_k8s.py renders with both and compares.

Validation: built-in kinds against the Kubernetes OpenAPI schemas of K8S_VERSION shipped by
kubernetes-validate, strict (unknown fields are errors); custom resources (ServiceMonitor,
TrainJob, PyTorchJob) against the schemas in infra/k8s/crds/*.schema.json, written from the
upstream CRDs, whose embedded pod templates refer to the same Kubernetes definitions.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

from tuneloop.config import REPO_ROOT

INFRA_DIR = REPO_ROOT / "infra"
K8S_DIR = INFRA_DIR / "k8s"
CRD_SCHEMA_DIR = K8S_DIR / "crds"
# The Kubernetes version the manifests are validated against (kubernetes-validate 1.37.0 ships
# 1.25 ... 1.37). 1.33: sidecar containers, the preStop sleep action and autoscaling/v2 are GA
# or on by default there, and Kubeflow Trainer v2.3 supports it.
K8S_VERSION = "1.33.0"
K8S_DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"

# (apiVersion, kind) -> schema file in infra/k8s/crds
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob.schema.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.schema.json",
}

# Kinds kustomize's namespace transformer leaves alone (cluster-scoped).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "APIService",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ClusterTrainingRuntime",
    "IngressClass",
    "RuntimeClass",
}

SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "images",
    "patches",
    "configMapGenerator",
    "generatorOptions",
}

# Strategic merge: list fields merged by key (the Kubernetes API's patchMergeKey); every other
# list is replaced by the patch's, as kustomize does for them.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "containerPorts": "containerPort",
    "servicePorts": "port",  # "ports", told apart by their items
}


class KustomizeError(Exception):
    """A kustomization that cannot be rendered (or uses a feature this renderer does not have)."""


# ---------------------------------------------------------------------------------------
# rendering


def load_yaml_documents(path: Path | str) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a file."""
    with open(path) as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def render_kustomization(path: Path | str) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize path` prints, as dicts (not in kustomize's order)."""
    root = Path(path).resolve()
    file = root / "kustomization.yaml"
    if not file.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    k = yaml.safe_load(file.read_text()) or {}
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{file}: not supported by tuneloop/infra.py: {sorted(unknown)}")

    docs: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        target = (root / entry).resolve()
        docs.extend(render_kustomization(target) if target.is_dir() else load_yaml_documents(target))
    options = k.get("generatorOptions", {})
    for gen in k.get("configMapGenerator", []):
        docs.append(_config_map(root, gen, options))

    for patch in k.get("patches", []):
        _apply_patch(root, docs, patch)
    if "namespace" in k:
        for doc in docs:
            _set_namespace(doc, k["namespace"])
    for group in k.get("labels", []):
        if (
            set(group) - {"pairs", "includeSelectors", "includeTemplates"}
            or group.get("includeSelectors")
            or group.get("includeTemplates")
        ):
            raise KustomizeError(
                f"{file}: labels other than plain pairs (no selectors, templates, fields) are not supported"
            )
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(group["pairs"])
    for image in k.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _config_map(root: Path, gen: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    if not options.get("disableNameSuffixHash"):
        raise KustomizeError(
            "configMapGenerator needs generatorOptions.disableNameSuffixHash: true here "
            "(name hashes and the references they rewrite are not rendered)"
        )
    if set(gen) - {"name", "files", "literals"}:
        raise KustomizeError(f"configMapGenerator {gen.get('name')}: only name, files, literals are supported")
    data: dict[str, str] = {}
    for entry in gen.get("files", []):
        key, _, rel = entry.rpartition("=") if "=" in entry else (None, None, entry)
        data[key or Path(rel).name] = (root / rel).read_text()
    for literal in gen.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}


def _set_namespace(doc: dict[str, Any], namespace: str) -> None:
    if doc.get("kind") in CLUSTER_SCOPED:
        return
    doc.setdefault("metadata", {})["namespace"] = namespace
    if doc.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
        for subject in doc.get("subjects", []):
            if subject.get("kind") == "ServiceAccount" and subject.get("namespace") in (None, "default"):
                subject["namespace"] = namespace


def _split_image(image: str) -> tuple[str, str]:
    """(name, suffix) where suffix is ':tag', '@digest' or ''."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_image(node: Any, rule: dict[str, Any]) -> None:
    """kustomize's images transformer: every containers[]/initContainers[] image, at any depth."""
    if isinstance(node, list):
        for item in node:
            _set_image(item, rule)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                if isinstance(container, dict) and isinstance(container.get("image"), str):
                    name, suffix = _split_image(container["image"])
                    if name == rule["name"]:
                        new = rule.get("newName", name)
                        if rule.get("digest"):
                            suffix = "@" + rule["digest"]
                        elif "newTag" in rule:
                            suffix = ":" + str(rule["newTag"])
                        container["image"] = new + suffix
        _set_image(value, rule)


def _matches(doc: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = doc.get("apiVersion", "").rpartition("/")
    if set(target) - {"group", "version", "kind", "name", "namespace"}:
        raise KustomizeError(f"patch target {target}: only group, version, kind, name, namespace are supported")
    checks = {
        "group": group,
        "version": version,
        "kind": doc.get("kind"),
        "name": doc.get("metadata", {}).get("name"),
        "namespace": doc.get("metadata", {}).get("namespace"),
    }
    return all(checks[key] == value for key, value in target.items())


def _apply_patch(root: Path, docs: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    if set(entry) - {"path", "patch", "target"}:
        raise KustomizeError(f"patch {entry}: only path, patch and target are supported")
    text = (root / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if isinstance(patch, list):  # JSON 6902
        if "target" not in entry:
            raise KustomizeError(f"JSON 6902 patch {entry}: needs a target")
        targets = [d for d in docs if _matches(d, entry["target"])]
        for doc in targets:
            for op in patch:
                _json6902(doc, op)
    else:
        target = entry.get("target") or {
            "kind": patch.get("kind"),
            "name": patch.get("metadata", {}).get("name"),
            **dict(zip(("group", "version"), _group_version(patch.get("apiVersion", "")))),
        }
        targets = [d for d in docs if _matches(d, target)]
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
        if isinstance(body.get("metadata"), dict):  # the patch's name selects, it never renames
            body["metadata"] = {k: v for k, v in body["metadata"].items() if k != "name"}
        for doc in targets:
            merged = strategic_merge(doc, body)
            doc.clear()
            doc.update(merged)
    if not targets:
        raise KustomizeError(f"patch {entry.get('path') or entry.get('target')}: matches no resource")


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """A strategic merge patch, as kustomize applies one: maps merge recursively (null deletes a
    key); lists in MERGE_KEYS merge by their key (the patch's items first, in its order, then
    the base's other items); other lists are replaced."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(key.startswith("$") for key in patch):
            raise KustomizeError(
                f"strategic merge directives ({[k for k in patch if k.startswith('$')]}) are not supported"
            )
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if field == "ports" and isinstance(patch, list) and isinstance(base, list):
        # A container's ports merge by containerPort, a Service's by port.
        field = (
            "containerPorts"
            if any(isinstance(p, dict) and "containerPort" in p for p in patch + base)
            else "servicePorts"
        )
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {item.get(key): item for item in base if isinstance(item, dict)}
        merged = [
            strategic_merge(by_key[item[key]], item, None) if item.get(key) in by_key else copy.deepcopy(item)
            for item in patch
        ]
        patched = {item.get(key) for item in patch}
        return merged + [item for item in base if not (isinstance(item, dict) and item.get(key) in patched)]
    return copy.deepcopy(patch)


def _json6902(doc: dict[str, Any], op: dict[str, Any]) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent: Any = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op["op"]
    if kind not in ("add", "remove", "replace"):
        raise KustomizeError(f"JSON 6902 op {kind!r} is not supported (add, remove, replace)")
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "remove":
            del parent[index]
        else:
            parent[index] = copy.deepcopy(op["value"])
        return
    if kind in ("remove", "replace") and last not in parent:
        raise KustomizeError(f"JSON 6902 {kind} {op['path']}: no such field")
    if kind == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(op["value"])


def manifest_key(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = doc.get("metadata", {})
    return (doc.get("apiVersion", ""), doc.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))


# ---------------------------------------------------------------------------------------
# validation


@lru_cache(maxsize=None)
def _k8s_definitions(version: str) -> dict[str, Any]:
    path = (
        importlib.resources.files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{version}-local-strict"
        / "_definitions.json"
    )
    return json.loads(path.read_text())


@lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str, version: str = K8S_VERSION):
    """A jsonschema validator for a custom resource, its Kubernetes references resolved to `version`."""
    schema = json.loads((CRD_SCHEMA_DIR / CRD_SCHEMAS[(api_version, kind)]).read_text())
    registry = Registry().with_resource(K8S_DEFINITIONS_ID, Resource.from_contents(_k8s_definitions(version)))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, registry=registry, format_checker=cls.FORMAT_CHECKER)


def _where(error) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(top)"


def validate_manifest(doc: dict[str, Any], version: str = K8S_VERSION) -> list[str]:
    """Errors of one manifest (empty list: valid). Built-in kinds: kubernetes-validate --strict
    against Kubernetes `version`; custom resources: infra/k8s/crds/*.schema.json. A kind known
    to neither is an error (kubernetes-validate would only warn)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if key in CRD_SCHEMAS:
        return [
            f"{name}: {_where(e)}: {e.message}"
            for e in sorted(crd_validator(*key, version=version).iter_errors(doc), key=lambda e: list(e.path))
        ]
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name}: {_where(e)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{name}: {e.message} (and no schema in {CRD_SCHEMA_DIR})"]
    return []


_VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_var_refs(text: str) -> list[str]:
    """Names a Kubernetes $(VAR) reference in a command, args or env value expands."""
    return _VAR_REF.findall(text)
