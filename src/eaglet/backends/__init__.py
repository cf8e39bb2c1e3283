"""Generation backends behind one async interface.

A backend answers batches of requests. `plan` groups `window` consecutive requests into the
batches it wants (the in-process model sorts a window by length into batches of `batch_size`; a
server takes one request at a time), and `concurrency` says how many batches may be in flight.

Request: {"id", "messages", "sampling"}. Result (per request, same order): {"response",
"reasoning", "output_ids" (or None), "prompt_tokens", "completion_tokens", "finish_reason",
"model", "cost" (or None), "latency_s", "attempts", "meta"}; or, once retries are spent,
{"error", "attempts"}. A failure every request would share raises `Abort`.
"""

from __future__ import annotations

from typing import Protocol

from eaglet.params import Params


class Backend(Protocol):
    name: str
    concurrency: int
    batch_size: int
    window: int

    def plan(self, requests: list[dict]) -> list[list[dict]]: ...

    async def generate(self, batch: list[dict]) -> list[dict]: ...

    async def close(self) -> None: ...


def make_backend(params: Params, name: str, threads: int | None = None) -> Backend:
    """Build the backend `name` of params.yaml."""
    from eaglet.target import load_tokenizer, spec_of

    cfg = params.backend(name)
    spec = spec_of(params)
    if cfg["kind"] == "transformers":
        from eaglet.backends.transformers import TransformersBackend

        return TransformersBackend(name, spec, cfg, threads=threads)
    if cfg["kind"] == "sglang":
        from eaglet.backends.sglang import SGLangBackend

        return SGLangBackend(name, cfg, load_tokenizer(spec), spec.name)
    if cfg["kind"] == "vllm":
        from eaglet.backends.vllm import VLLMBackend

        backend = VLLMBackend(
            name, cfg, spec, load_tokenizer(spec), params.target["max_length"], threads
        )
        backend.start()  # here, in the main thread: the server's parent-death signal needs it
        return backend
    from eaglet.backends.openai import OpenAIBackend

    return OpenAIBackend(name, cfg, lambda: load_tokenizer(spec))
