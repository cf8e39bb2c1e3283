"""Acceptance measured by a serving engine: vLLM serves the target with the drafter's vLLM export.

One server without the drafter (plain greedy: the reference outputs and tokens/s), then one per
`num_steps` with `--speculative-config {"method": "eagle3", ...}`. Each runs the same held-out
prompts (token ids in, `/v1/completions`, greedy, the target's stop ids) and the speculative
counters of `GET /metrics` are read before and after, so the numbers are the run's deltas: mean
acceptance length = 1 + accepted / drafts (vLLM's definition), the acceptance rate per draft
position (given the positions before it), tokens/s with and without the drafter.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eaglet.engines.vllm import Engine, ServeConfig, eagle3, spec_counters
from eaglet.errors import EagletError
from eaglet.speculative import against_greedy


def complete(http: httpx.Client, model: str, prompt: list[int], max_new: int, stop: list[int]):
    """One greedy completion of `prompt` (token ids): its output ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_new,
        "temperature": 0.0,
        "stop_token_ids": stop,
        "return_token_ids": True,
    }
    r = http.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def run(
    engine: Engine, model: str, prompts: list[list[int]], max_new: int, stop: list[int], conc: int
) -> dict:
    """Every prompt through the engine (`conc` at a time); outputs, seconds and counter deltas."""
    before = spec_counters(engine.metrics())
    t0 = time.perf_counter()
    with (
        httpx.Client(base_url=engine.url, timeout=3600.0, trust_env=False) as http,
        ThreadPoolExecutor(conc) as pool,
    ):
        outputs = list(pool.map(lambda p: complete(http, model, p, max_new, stop), prompts))
    seconds = time.perf_counter() - t0
    delta = spec_counters(engine.metrics()) - before
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens, "counters": delta}


def measure(
    serve: ServeConfig,
    export: Path,
    prompts: list[list[int]],
    num_steps: list[int],
    max_new: int,
    stop: list[int],
    concurrency: int = 1,
    startup_timeout_s: float = 900.0,
    log: Path | None = None,
) -> dict:
    """Plain and speculative runs of the prompts on the engine; metrics per num_steps."""
    out: dict = {"engine": "vllm", "dtype": serve.dtype, "enforce_eager": serve.enforce_eager}
    out["concurrency"] = concurrency
    with Engine(serve, log=log, startup_timeout_s=startup_timeout_s) as engine:
        plain = run(engine, serve.served_name, prompts, max_new, stop, concurrency)
    startup = {"plain": engine.startup_s}
    greedy_tps = plain["tokens"] / plain["seconds"]
    out["greedy_tokens_per_s"] = round(greedy_tps, 2)
    out["greedy_outputs"] = plain["outputs"]
    for s in num_steps:
        spec = dataclasses.replace(serve, speculative=eagle3(export.resolve(), s))
        with Engine(spec, log=log, startup_timeout_s=startup_timeout_s) as engine:
            r = run(engine, serve.served_name, prompts, max_new, stop, concurrency)
        startup[f"num_steps_{s}"] = engine.startup_s
        m = r["counters"].summary()
        tps = r["tokens"] / r["seconds"]
        same = [a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True)]
        m.update(generated_tokens=r["tokens"], **against_greedy(same, tps, greedy_tps))
        out[f"num_steps_{s}"] = m
    out["startup_s"] = startup
    return out


def measure_running(
    url: str,
    model: str,
    prompts: list[list[int]],
    num_steps: int,
    max_new: int,
    stop: list[int],
    concurrency: int = 1,
) -> dict:
    """The prompts on an operator's engine already serving the drafter with `num_steps` draft
    tokens: acceptance from its counters; no plain run, so no greedy reference and no speedup."""
    with Engine(url=url) as engine:
        r = run(engine, model, prompts, max_new, stop, concurrency)
    m = r["counters"].summary()
    if len(m["acceptance_rate"]) != num_steps:
        raise EagletError(
            f"{url}: the engine drafts {len(m['acceptance_rate'])} tokens a step (its "
            f"num_speculative_tokens), evaluate.num_steps says {num_steps}"
        )
    m.update(generated_tokens=r["tokens"], tokens_per_s=round(r["tokens"] / r["seconds"], 2))
    m.update(greedy_equal=None, greedy_mismatches=None, greedy_tokens_per_s=None, speedup=None)
    return {
        "engine": "vllm",
        "operator": True,
        "concurrency": concurrency,
        "greedy_tokens_per_s": None,
        f"num_steps_{num_steps}": m,
    }
