"""Claim: which generation backend is faster on this machine for the demo's answers: vLLM (a
managed server, token ids in and out) or the in-process transformers backend.

Both run in one process on the same slice of the demo's instructions (`data/demo/
instructions.jsonl`, the bulk of the demo's generation), greedy, fp32, with the demo's
`max_new_tokens` (128) and batch (16 prompts in flight; vLLM --max-num-seqs 16, eager). Both are
loaded first; then the slice is sent in rounds of one batch, each round through transformers and
then vLLM, so that the load of a shared machine falls on both alike. Reported: completion
tokens/s of each (generation only), vLLM's start-up time, the transformers model load time, the
per-round spread, and on how many prompts the two answered the same ids.

    .venv/bin/python -m benchmarks.generation_engines [--prompts 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from eaglet.engines.lookup import generator
from eaglet.formats.io import read_jsonl
from eaglet.model.target import spec_of
from eaglet.params import from_dict

ROOT = Path(__file__).resolve().parents[1]


async def _run(backend, requests: list[dict]) -> tuple[list[dict], float]:
    """Every request through the backend, `concurrency` batches in flight; results, seconds."""
    batches = backend.plan([dict(r) for r in requests])
    queue: asyncio.Queue = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)
    results: dict[str, dict] = {}

    async def worker() -> None:
        while not queue.empty():
            batch = queue.get_nowait()
            for req, res in zip(batch, await backend.generate(batch), strict=True):
                results[req["id"]] = res

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(backend.concurrency)))
    seconds = time.perf_counter() - t0
    return [results[r["id"]] for r in requests], seconds


async def rounds(backends: dict, requests: list[dict], size: int) -> dict:
    """The requests in rounds of `size`, each round through every backend in turn."""
    out = {name: {"results": [], "seconds": []} for name in backends}
    try:
        for i in range(0, len(requests), size):
            for name, backend in backends.items():
                results, seconds = await _run(backend, requests[i : i + size])
                out[name]["results"] += results
                out[name]["seconds"].append(seconds)
                tokens = sum(r["completion_tokens"] for r in results)
                print(f"round {i // size}: {name} {tokens / seconds:.1f} tok/s", flush=True)
    finally:
        for backend in backends.values():
            await backend.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = list(read_jsonl(ROOT / "data" / "demo" / "instructions.jsonl"))[: args.prompts]
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0}
    sampling |= {"top_k": -1, "seed": 0}
    requests = [
        {"id": str(i), "messages": [{"role": "user", "content": r["instruction"]}], "sampling": s}
        for i, (r, s) in enumerate((r, sampling) for r in rows)
    ]
    common = {"dtype": "float32", "threads": args.threads}
    params = from_dict(
        {
            "target": {"model": "smollm2-135m-instruct"},
            "backends": {
                "transformers": {"kind": "transformers", "batch_size": args.batch, **common},
                "vllm": {"kind": "vllm", "max_num_seqs": args.batch, "concurrency": args.batch}
                | common,
            },
            "generation": {"backend": "transformers"},
            "datasets": {"x": {"path": "unused.jsonl"}},
        },
        ROOT / "params.yaml",
    )
    report: dict = {"prompts": len(requests), "max_new_tokens": args.max_new_tokens}
    report["batch"], report["threads"] = args.batch, args.threads
    backends = {}
    for name in ("transformers", "vllm"):
        t0 = time.perf_counter()
        cfg = params.backend(name)
        target, max_length = spec_of(params), params.target["max_length"]
        backends[name] = generator(cfg["kind"], name, cfg, target, max_length, args.threads)
        report[name] = {"ready_s": round(time.perf_counter() - t0, 1)}
    runs = asyncio.run(rounds(backends, requests, args.batch))
    outputs = {}
    for name, r in runs.items():
        tokens = sum(x["completion_tokens"] for x in r["results"])
        seconds = sum(r["seconds"])
        per_round = [
            sum(x["completion_tokens"] for x in r["results"][i : i + args.batch]) / s
            for i, s in zip(range(0, len(requests), args.batch), r["seconds"], strict=True)
        ]
        outputs[name] = [x["output_ids"] for x in r["results"]]
        report[name].update(
            seconds=round(seconds, 1),
            completion_tokens=tokens,
            tokens_per_s=round(tokens / seconds, 1),
            per_round_tokens_per_s=[round(t, 1) for t in per_round],
        )
    same = sum(a == b for a, b in zip(outputs["transformers"], outputs["vllm"], strict=True))
    report["same_output_ids"] = f"{same}/{len(requests)}"
    report["vllm_over_transformers"] = round(
        report["vllm"]["tokens_per_s"] / report["transformers"]["tokens_per_s"], 2
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
