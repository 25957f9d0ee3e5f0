# The tuneloop image: flows, the tuneloop package and configs with requirements.lock's pinned packages.
# Runs the Prefect worker of infra/compose.yaml, the flow-run Jobs of the Kubernetes work pool
# and the training pods (TrainJob / PyTorchJob: the same code at the same path, /opt/tuneloop).
# torch from PyPI is its CUDA build on Linux, so one image serves CPU and GPU nodes.
# Build from the repo root:
#   docker build -f infra/images/tuneloop.Dockerfile -t tuneloop:latest .
FROM python:3.11-slim-bookworm
# g++: torch.compile and DeepSpeed's JIT ops build at run time; git: lineage (git commit).
RUN apt-get update && apt-get install -y --no-install-recommends g++ git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/tuneloop
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir pip==25.3 && pip install --no-cache-dir -r requirements.lock
COPY tuneloop tuneloop
COPY flows flows
COPY bentos bentos
COPY monitoring monitoring
COPY configs configs
COPY prefect.yaml ./
RUN pip install --no-cache-dir --no-deps -e .
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
