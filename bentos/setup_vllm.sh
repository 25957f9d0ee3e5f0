#!/bin/sh
# The gpu bento's image only (tuneloop/packaging/bento.py: TARGETS["gpu"], docker.setup_script):
# vLLM in its own venv at /opt/vllm, because it pins its own torch and transformers. The
# packaged config of a gpu bento serves with serving.engine: vllm and this venv's python
# (bento.gpu_engine; tuneloop/serving/vllm_engine.py runs vLLM's OpenAI server behind
# tuneloop's routes).
set -eu
python -m venv /opt/vllm
/opt/vllm/bin/pip install --no-cache-dir "vllm==0.33.0"
