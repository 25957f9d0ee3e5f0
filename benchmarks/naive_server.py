"""The baseline for benchmarks/serving.py: a model server as the classic tutorial writes it.

    python benchmarks/naive_server.py --model-dir .tuneloop/models/tiny-base --port 8000

FastAPI + a transformers `pipeline("text-generation")` + uvicorn, one OpenAI-ish route,
`POST /v1/completions`. Each request runs the pipeline on its own, one at a time (a lock
around the call: the tutorial's pipeline is not safe to call from several threads, and
that is what serialises it). No batching, no streaming: the answer comes when the whole
generation is done, so a client's time to first token is its end-to-end latency.

Two things are not the tutorial's, so that the comparison is about serving and nothing
else: greedy decoding (the benchmark sends temperature 0, so every system generates the
same tokens), and `usage.completion_tokens` counted from the generated token ids.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid

from pydantic import BaseModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class CompletionRequest(BaseModel):
    model: str = "naive"
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0


def create_app(model_dir: str, num_threads: int | None = None):
    import torch
    from fastapi import FastAPI
    from transformers import pipeline

    if num_threads:
        torch.set_num_threads(num_threads)
    generator = pipeline("text-generation", model=model_dir, device="cpu")
    lock = threading.Lock()
    app = FastAPI(title="naive completions server")

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    def complete(req: CompletionRequest):
        # Sync route: FastAPI runs it in its thread pool; the lock keeps one generation at a time.
        with lock:
            out = generator(
                req.prompt,
                max_new_tokens=req.max_tokens,
                do_sample=req.temperature > 0,
                temperature=req.temperature if req.temperature > 0 else None,
                return_tensors=True,  # token ids, so usage counts tokens instead of re-encoding text
            )[0]
        # With return_tensors the pipeline gives the whole sequence (prompt + new tokens).
        prompt_tokens = len(generator.tokenizer(req.prompt, add_special_tokens=False)["input_ids"])
        new_ids = list(out["generated_token_ids"])[prompt_tokens:]
        stop_ids = generator.model.generation_config.eos_token_id or []
        stop_ids = set(stop_ids if isinstance(stop_ids, list) else [stop_ids])
        finish = "length"
        if new_ids and new_ids[-1] in stop_ids:  # the stop token itself is not part of the answer
            new_ids, finish = new_ids[:-1], "stop"
        text = generator.tokenizer.decode(new_ids, skip_special_tokens=True)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(new_ids),
                "total_tokens": prompt_tokens + len(new_ids),
            },
        }

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    uvicorn.run(create_app(args.model_dir, args.num_threads), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
