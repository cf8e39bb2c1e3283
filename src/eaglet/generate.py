"""The responses stage: the target regenerates the last assistant turn of every prompt.

Requests go to the dataset's backend in the batches it plans, `concurrency` batches in flight,
drawn lazily from one iterator by a fixed pool of workers; the responses file is written
atomically in prompt order once every prompt has its answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from eaglet.backends import Backend, make_backend
from eaglet.io import read_jsonl, write_json, write_jsonl_zst
from eaglet.keys import Keys, sidecar_of
from eaglet.params import Params
from eaglet.progress import Progress
from eaglet.records import response_record


async def drain(backend: Backend, batches: Iterator[list[dict]], sink) -> None:
    """Run every batch through the backend with `backend.concurrency` workers."""

    async def worker() -> None:
        for batch in batches:  # a shared iterator: each batch is taken by one worker
            sink(batch, await backend.generate(batch))

    await asyncio.gather(*(worker() for _ in range(backend.concurrency)))


def build(
    params: Params,
    dataset: str,
    out: Path | None = None,
    threads: int | None = None,
    quiet: bool = False,
) -> Path:
    """Generate the dataset's responses and write them with their sidecar; return the path."""
    keys = Keys(params)
    prov = keys.provenance("responses", dataset)
    out = Path(out) if out else keys.path("responses", dataset)
    prompts = list(read_jsonl(keys.path("prompts", dataset)))
    sampling = params.generation(dataset)
    backend_name = sampling.pop("backend")
    backend = make_backend(params, backend_name, threads=threads)
    requests = [{"id": p["id"], "messages": p["messages"], "sampling": sampling} for p in prompts]
    progress = Progress(f"responses {dataset}", len(requests), quiet=quiet)
    results: dict[str, dict] = {}

    def sink(batch: list[dict], answers: list[dict]) -> None:
        for req, ans in zip(batch, answers, strict=True):
            results[req["id"]] = ans
        progress.update(
            len(batch),
            tokens=sum(a["completion_tokens"] for a in answers),
            cost=sum(a.get("cost") or 0.0 for a in answers),
        )

    async def run() -> None:
        try:
            await drain(backend, iter(backend.plan(requests)), sink)
        finally:
            await backend.close()

    asyncio.run(run())
    progress.close()
    records = [response_record(p, results[p["id"]], backend_name, sampling) for p in prompts]
    stats = {
        "responses": len(records),
        "completion_tokens": sum(r["completion_tokens"] for r in records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
        "cost": sum(r["cost"] or 0.0 for r in records),
        "elapsed_s": round(time.monotonic() - progress.start, 3),
    }
    write_json(sidecar_of(out), {"provenance": prov, "stats": stats})
    write_jsonl_zst(out, records)
    return out
