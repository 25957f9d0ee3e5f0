"""llama.cpp's tools, from its source as PyPI ships it: the GGUF converter, llama-quantize and
llama-server.

The `llama-cpp-python` sdist on PyPI carries the whole llama.cpp tree (vendor/llama.cpp), pinned
here (LLAMA_CPP_PYTHON). Fetched once into the tools folder (TUNELOOP_LLAMA_CPP_DIR, default
<repo>/.tuneloop-llamacpp, shared by every config of this clone):

    source()            the llama.cpp tree: `pip download` of the sdist (~75 MB) and unpacked
    convert(dir, out)   its convert_hf_to_gguf.py on a Hugging Face folder -> a GGUF file
                        (f32, bf16, q8_0; this venv runs it: gguf and sentencepiece are locked)
    quantize(src, out)  llama-quantize of an f32 GGUF (q4_k_m)
    build(tool)         CMake build of one of its programs (llama-server, llama-quantize) with
                        the host's native CPU flags: ~10 min on 2 cores for the first one,
                        a minute for the next (the ggml library is shared); needs cmake and a
                        C++ compiler (Debian: `apt-get install cmake g++`)
    binary(tool)        the built program, or None
    serve(gguf)         llama-server on a GGUF file, on a free local port, for the length of a
                        `with` block (the GGUF's own chat template: --jinja)

What convert() mends in a folder saved by transformers 5 before the converter reads it (both
met on the demo model, a GPT-2 with its own byte-level BPE):
- a GPT-2 config without `n_ctx` (transformers 5 saves `n_positions` alone; the converter's
  GPT-2 class reads `n_ctx`): a staged copy of config.json with n_ctx = n_positions.
- a tokenizer llama.cpp's table does not know. The converter names the BPE pre-tokenizer
  (the regex that splits text before the merges) by hashing the token ids of a test string,
  so a vocabulary of its own is unknown even when its pre-tokenizer is GPT-2's. Where
  tokenizer.json spells out exactly GPT-2's (byte-level, GPT-2's regex, no prefix space, no
  normaliser: pre_tokenizer_name()), the converter is told "gpt-2" for an unknown hash; any
  other unknown tokenizer still fails, as upstream does.
`tuneloop package --target gguf` (packaging/gguf.py) and `make bench-peers`
(benchmarks/peers.py) use these; nothing else in the product needs llama.cpp.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

from tuneloop.config import REPO_ROOT
from tuneloop.packaging.common import PackagingError, say
from tuneloop.ports import die_with_parent, free_port, stop_process_group

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TOOLS = ("llama-server", "llama-quantize")
CONVERTER_TYPES = ("f32", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes itself
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M"}  # llama-quantize from the f32 file
# Native CPU flags but no AMX: ggml's AMX kernels stopped llama-server with SIGILL on this
# project's Xeon hosts (gdb: `tilezero` in tinygemm_kernel_amx<block_q8_0> on loading any q8_0
# file), their tile state not granted to them; AVX-512 (VNNI, BF16) stays. GCC lets an explicit
# -mno-* win over what -march=native implies, whatever the order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_DIR = "build-cpu"


def tools_dir() -> Path:
    return Path(os.environ.get("TUNELOOP_LLAMA_CPP_DIR") or REPO_ROOT / ".tuneloop-llamacpp")


def _tree(root: Path) -> Path | None:
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found and (found[-1] / "convert_hf_to_gguf.py").exists() else None


def source(progress: Callable[[str], None] | None = None) -> Path:
    """The llama.cpp tree, fetched from PyPI the first time."""
    root = tools_dir()
    if (tree := _tree(root)) is not None:
        return tree
    root.mkdir(parents=True, exist_ok=True)
    sdists = root / "sdist"
    say(progress, f"fetching llama.cpp's source: {LLAMA_CPP_PYTHON} sdist from PyPI into {root} (once, ~75 MB)")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON]
        + ["-d", str(sdists)],
        capture_output=True,
        text=True,
    )
    archives = sorted(sdists.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise PackagingError(
            f"could not fetch llama.cpp's source ({LLAMA_CPP_PYTHON} from PyPI): "
            f"{(done.stderr or done.stdout).strip()[-400:] or 'no sdist downloaded'}"
        )
    partial = root / "unpacking"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(partial, filter="data")
    for entry in partial.iterdir():  # moved in whole: a cut unpack leaves no half tree behind
        entry.rename(root / entry.name)
    partial.rmdir()
    if (tree := _tree(root)) is None:
        raise PackagingError(f"{archives[-1].name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


# Runs llama.cpp's converter with one change: where its table of tokenizer hashes has no entry,
# the pre-tokenizer named in argv[2] (read from tokenizer.json by pre_tokenizer_name) instead
# of NotImplementedError. argv: the llama.cpp tree, the name or "", then the converter's own.
_CONVERT = """import os, runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.argv = [os.path.join(tree, "convert_hf_to_gguf.py"), *sys.argv[3:]]
sys.path[0:0] = [tree]
if pre:
    from conversion import base
    table = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return table(self, tokenizer)
        except NotImplementedError:
            base.logger.warning("tokenizer.ggml.pre = %r: tokenizer.json's pre-tokenizer (its vocabulary is not in the table)", pre)
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def pre_tokenizer_name(model_dir: Path) -> str | None:
    """llama.cpp's name for the folder's BPE pre-tokenizer where tokenizer.json spells out exactly
    one it implements, whatever the vocabulary: "gpt-2" for GPT-2's byte-level BPE (ByteLevel with
    its regex and no prefix space, no normaliser, plain merges), which llama.cpp splits with the
    same regex. None for anything else."""
    try:
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    gpt2 = (
        spec.get("normalizer") is None
        and model.get("type") == "BPE"
        and not model.get("byte_fallback")
        and not model.get("ignore_merges")
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
    )
    return "gpt-2" if gpt2 else None


def _staged(model_dir: Path, stage: Path) -> Path:
    """model_dir, or a copy in `stage` (links to its files, a mended config.json) where the
    converter needs what transformers 5 no longer writes: GPT-2's n_ctx."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return model_dir  # the converter says what is wrong
    if config.get("model_type") != "gpt2" or "n_ctx" in config or "n_positions" not in config:
        return model_dir
    stage.mkdir(parents=True, exist_ok=True)
    for entry in model_dir.iterdir():
        if entry.name != "config.json":
            (stage / entry.name).symlink_to(entry.resolve())
    (stage / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}, indent=2))
    return stage


def convert(model_dir: Path, out: Path, outtype: str = "f32", progress: Callable[[str], None] | None = None) -> Path:
    """A Hugging Face model folder as one GGUF file (outtype: f32, bf16 or q8_0)."""
    if outtype not in CONVERTER_TYPES:
        raise PackagingError(f"the converter writes {', '.join(CONVERTER_TYPES)}, not {outtype!r}")
    tree = source(progress)
    model_dir = Path(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "gguf-py"), os.environ.get("PYTHONPATH")])),
    }
    say(progress, f"converting {model_dir} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent) as tmp:
        staged = _staged(model_dir, Path(tmp) / "model")
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(tree), pre_tokenizer_name(model_dir) or ""]
            + [str(staged), "--outtype", outtype, "--outfile", str(partial)],
            capture_output=True,
            text=True,
            env=env,
        )
    return _finish(done, partial, out, f"llama.cpp's converter failed on {model_dir} ({outtype})", started, progress)


def quantize(
    src: Path,
    out: Path,
    qtype: str = "q4_k_m",
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """llama-quantize of an f32 (or bf16) GGUF into one of QUANTIZE_TYPES (built once if need be)."""
    if qtype not in QUANTIZE_TYPES:
        raise PackagingError(f"llama-quantize is run here for {', '.join(QUANTIZE_TYPES)}, not {qtype!r}")
    tool = binary("llama-quantize") or build("llama-quantize", progress)
    partial = out.with_name(out.name + ".partial")
    say(progress, f"quantizing {src.name} to {QUANTIZE_TYPES[qtype]} with llama-quantize")
    started = time.perf_counter()
    done = subprocess.run(
        [str(tool), str(src), str(partial), QUANTIZE_TYPES[qtype], str(threads or os.cpu_count() or 2)],
        capture_output=True,
        text=True,
        env=library_env(tool),
    )
    return _finish(done, partial, out, f"llama-quantize failed on {src} ({qtype})", started, progress)


def _finish(done, partial: Path, out: Path, failure: str, started: float, progress) -> Path:
    """A tool's run that wrote `partial`: moved to `out` when it succeeded, else removed and the
    tool's last lines raised after `failure`."""
    if done.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise PackagingError(f"{failure}:\n{tail}")
    partial.replace(out)
    say(progress, f"{out.name}: {out.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - started:.0f} s")
    return out


def binary(tool: str) -> Path | None:
    """The built program (llama-server, llama-quantize), or None when it is not built."""
    path = (
        Path(os.environ["TUNELOOP_LLAMA_SERVER"])
        if tool == "llama-server" and os.environ.get("TUNELOOP_LLAMA_SERVER")
        else None
    )
    if path is None:
        tree = _tree(tools_dir())
        path = tree / BUILD_DIR / "bin" / tool if tree is not None else None
    return path if path is not None and path.exists() and os.access(path, os.X_OK) else None


def build(tool: str, progress: Callable[[str], None] | None = None, jobs: int | None = None) -> Path:
    """Build one of llama.cpp's programs from the fetched source (once; native CPU flags)."""
    if tool not in TOOLS:
        raise PackagingError(f"unknown llama.cpp tool {tool!r}: one of {', '.join(TOOLS)}")
    if (built := binary(tool)) is not None:
        return built
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        raise PackagingError(
            f"building llama.cpp's {tool} needs {' and '.join(missing)} (Debian: apt-get install cmake g++)"
        )
    tree = source(progress)
    build_dir = tree / BUILD_DIR
    jobs = jobs or os.cpu_count() or 2
    log_file = tools_dir() / f"build-{tool}.log"
    say(
        progress,
        f"building llama.cpp's {tool} with CMake ({jobs} jobs; the first build takes ~10 min on 2 cores; log {log_file})",
    )
    started = time.perf_counter()
    with open(log_file, "w") as log_out:
        for cmd in (
            ["cmake", "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"]
            + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
            + ([f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if platform.machine() == "x86_64" else []),
            ["cmake", "--build", str(build_dir), "--target", tool, f"-j{jobs}"],
        ):
            if subprocess.run(cmd, cwd=tree, stdout=log_out, stderr=subprocess.STDOUT).returncode != 0:
                tail = "\n".join(log_file.read_text().strip().splitlines()[-8:])
                raise PackagingError(f"building llama.cpp's {tool} failed (log {log_file}):\n{tail}")
    if (built := binary(tool)) is None:
        raise PackagingError(f"the build finished without {build_dir / 'bin' / tool}")
    say(progress, f"{tool} built in {time.perf_counter() - started:.0f} s")
    return built


def library_env(tool_path: Path) -> dict[str, str]:
    """The environment a built program runs in (its shared ggml/llama libraries sit beside it)."""
    return {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(tool_path.parent), os.environ.get("LD_LIBRARY_PATH")])),
    }


@contextlib.contextmanager
def serve(
    gguf: Path,
    alias: str = "model",
    context: int = 4096,
    threads: int = 2,
    log_path: Path | None = None,
    timeout: float = 300.0,
) -> Iterator[str]:
    """llama-server on `gguf` (one slot, greedy-capable, the GGUF's chat template through its
    Jinja engine) on a free local port; yields its base URL and stops it when the block ends."""
    tool = binary("llama-server")
    if tool is None:
        raise PackagingError(
            "llama-server is not built (llama_cpp.build('llama-server'); `make bench-peers` builds it)"
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(tool), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", alias]
    argv += ["-c", str(context), "-t", str(threads), "-np", "1", "--jinja", "--no-webui"]
    log_path = log_path or Path(gguf).with_suffix(".server.log")
    with open(log_path, "w") as log_out:
        # its own group, stopped with the block; and it stops if this process is killed first
        proc = subprocess.Popen(
            die_with_parent(argv),
            stdout=log_out,
            stderr=subprocess.STDOUT,
            env=library_env(tool),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").strip().splitlines()[-8:])
                raise PackagingError(f"llama-server exited ({proc.returncode}) on {gguf} (log {log_path}):\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise PackagingError(f"llama-server on {gguf} not ready after {timeout:.0f} s (log {log_path})")
            time.sleep(0.2)
        yield url
    finally:
        stop_process_group(proc)
