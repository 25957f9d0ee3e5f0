"""Packaging: the MLflow champion as a built, infra-validated BentoML bento, or as one GGUF file.

    deploy_champion(cfg)   import -> build -> infra_validate -> mark deployed
    export_gguf(cfg)       download -> convert (-> quantize) -> agreement -> record (gguf.py)

One module per concern; this package imports none of them (import what you use from its
module): bento.py (1, 2), server.py (3, and the foreground `tuneloop serve`),
deployment.py (4, deploy_champion, serve_plan), common.py (the error and the environment
of the bentoml processes), gguf.py (`tuneloop package --target gguf`: the champion, another
version or an `ft:` model merged into its base, for llama.cpp and Ollama, checked against the
served model's greedy answers and recorded on the MLflow version; docs/gguf.md), llama_cpp.py
(llama.cpp's converter, llama-quantize and llama-server from the llama-cpp-python sdist).

1. import_champion: the champion's files (from the MLflow registry) become a model in the
   BentoML model store under cfg.bentoml_home, tagged `<registered name>:v<version>-<run>`,
   with labels pointing back to MLflow (registered model, version, run id). Idempotent:
   the same MLflow version is imported once.
2. build_bento: `bentoml build` of bentos/ from a staging copy that adds
   bentos/packaged_config.yaml -- the serving section with `bento_model` (which makes the
   bento reference the model), the served name (= registered name), version and aliases.
   bentos/service.py reads that file when it sits next to it. Python packages are pinned
   to the exact versions installed here (the bentofile's packages and everything they
   require), `lock_packages: false`, so the build needs no network.
3. infra_validate (TFX's InfraValidator): `bentoml serve <bento>` on a free local port,
   wait for /readyz, one /v1/completions and one /v1/chat/completions, stop it.
4. Only a bento that passed is recorded: the `deployed.bento` tag on the MLflow version
   and <home>/deployed.json (what `tuneloop serve` starts). A failed one changes nothing.

Images. A bento describes its Docker image; two variants (`target`, config bento.target):
  cpu  -- bento `tuneloop_llm`: python:3.11-slim (debian), torch's CPU wheel
          (`torch==<v>+cpu` from https://download.pytorch.org/whl/cpu; the image installs
          with uv, so the build-stage env UV_INDEX_STRATEGY=unsafe-best-match lets every
          other pin come from PyPI).
  gpu  -- bento `tuneloop_llm_cuda`: docker.cuda_version 12.8 (nvidia/cuda:12.8.1-cudnn-
          runtime-ubuntu24.04), torch's default PyPI wheel (the CUDA build; its nvidia-*
          runtime wheels come pinned by torch itself). The image brings CUDA; the serving
          engine decides the device (tuneloop/serving/engine.py).
The Dockerfile is generated inside the bento (<bento>/env/docker/Dockerfile). Building
the image needs a Docker daemon (none on this machine) and the package indexes:

    BENTOML_HOME=<home>/bentoml bentoml containerize tuneloop_llm:<bento version> -t tuneloop-llm:<bento version>
    docker run --rm -p 3000:3000 tuneloop-llm:<bento version>                        # cpu
    docker run --rm --gpus all -p 3000:3000 tuneloop-llm-cuda:<bento version>       # gpu

(bento.containerize_command() prints the first line for a given bento.) The bento references
its model in the store; containerize copies it into the image, and `bentoml export
<bento> x.bento` gives a self-contained archive for another machine.
"""
