"""Generation backends behind one async interface.

A backend turns batches of requests into results. `plan` groups requests into the batches it
wants (the in-process model batches by length; a server takes one request at a time) and
`concurrency` says how many batches may be in flight at once.

Request: {"id", "messages", "sampling"}. Result (per request, same order): {"response",
"output_ids" (or None), "prompt_tokens", "completion_tokens", "finish_reason", "model",
"latency_s"}, optionally "reasoning" and "cost".
"""

from __future__ import annotations

from typing import Protocol

from eaglet.params import Params


class Backend(Protocol):
    name: str
    concurrency: int

    def plan(self, requests: list[dict]) -> list[list[dict]]: ...

    async def generate(self, batch: list[dict]) -> list[dict]: ...

    async def close(self) -> None: ...


def make_backend(params: Params, name: str, threads: int | None = None) -> Backend:
    """Build the backend `name` of params.yaml."""
    cfg = params.backend(name)
    if cfg["kind"] == "transformers":
        from eaglet.backends.transformers import TransformersBackend
        from eaglet.target import resolve

        t = params.target
        spec = resolve(t["model"], t.get("revision"), params.root)
        return TransformersBackend(name, spec, cfg, threads=threads)
    raise NotImplementedError(f"backend kind '{cfg['kind']}' is not available yet")
