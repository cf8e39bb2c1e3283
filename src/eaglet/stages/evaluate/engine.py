"""Acceptance measured by a serving engine: vLLM serves the target with the drafter's vLLM export.

One server without the drafter (plain greedy: the reference outputs and tokens/s), then one per
`num_steps` with `--speculative-config {"method": "eagle3", ...}` (`"dflash"` for a DFlash drafter,
whose one num_steps is block_size - 1). Each runs every suite's
prompts (token ids in, `/v1/completions`, the target's stop ids), the speculative server once per
temperature: 0 is greedy, above 0 is speculative sampling (vLLM's rejection sampler; request i
seeded with seed + i). The speculative counters of `GET /metrics` are read before and after each
(suite, temperature) run, so the numbers are its deltas: mean acceptance length = 1 + accepted /
drafts (vLLM's definition), the acceptance rate per draft position (given the positions before
it), tokens/s with and without the drafter.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
from eaglet.errors import EagletError
from eaglet.formats.metrics import EngineInfo, Runs, Startup, run_of
from eaglet.formats.speculative import dflash, eagle3, spec_counters
from eaglet.graph.keys import Spec
from eaglet.model.speculative import against_greedy

if TYPE_CHECKING:
    from eaglet.stages.evaluate.spec import EvaluateSettings, Setup


def complete(
    http: httpx.Client,
    model: str,
    prompt: list[int],
    max_new: int,
    stop: list[int],
    temperature: float = 0.0,
    seed: int = 0,
):
    """One completion of `prompt` (token ids): its output ids (sampled with `seed` if t > 0)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_new,
        "temperature": temperature,
        "stop_token_ids": stop,
        "return_token_ids": True,
    }
    if temperature > 0:
        body["seed"] = seed
    r = http.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def run(
    engine: Engine,
    model: str,
    prompts: list[list[int]],
    max_new: int,
    stop: list[int],
    conc: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """Every prompt through the engine (`conc` at a time); outputs, seconds and counter deltas."""
    before = spec_counters(engine.metrics())
    t0 = time.perf_counter()
    with (
        httpx.Client(base_url=engine.url, timeout=3600.0, trust_env=False) as http,
        ThreadPoolExecutor(conc) as pool,
    ):
        outputs = list(
            pool.map(
                lambda ip: complete(http, model, ip[1], max_new, stop, temperature, seed + ip[0]),
                enumerate(prompts),
            )
        )
    seconds = time.perf_counter() - t0
    delta = spec_counters(engine.metrics()) - before
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens, "counters": delta}


@dataclasses.dataclass(frozen=True)
class EngineSuite:
    """One suite on the engine: its plain greedy outputs and tokens/s (None on an operator's
    engine: no plain run), and its speculative runs per temperature and num_steps."""

    greedy_outputs: list[list[int]] | None
    greedy_tokens_per_s: float | None
    runs: Runs


def measure(
    serve: ServeConfig,
    export: Path,
    suites: dict[str, list[list[int]]],
    cfg: EvaluateSettings,
    stop: list[int],
    startup_timeout_s: float = 900.0,
    log: Path | None = None,
    method: str = "eagle3",
) -> tuple[EngineInfo, dict[str, EngineSuite]]:
    """Plain and speculative runs of every suite on the engine. `cfg`: the evaluate settings
    (num_steps, max_new_tokens, temperatures, seed, engine_concurrency). Per suite: its greedy
    outputs and tokens/s, and per temperature and num_steps the speculative run. `method`:
    the drafter's, eagle3 or dflash (vLLM's speculative method)."""
    speculative = {"eagle3": eagle3, "dflash": dflash}[method]
    max_new, conc = cfg.max_new_tokens, cfg.engine_concurrency
    with Engine(serve, log=log, startup_timeout_s=startup_timeout_s) as engine:
        plain = {
            n: run(engine, serve.served_name, p, max_new, stop, conc) for n, p in suites.items()
        }
    plain_startup, startup = engine.startup_s, {}
    runs: dict[str, Runs] = {name: {} for name in suites}
    for s in cfg.num_steps:
        spec = dataclasses.replace(serve, speculative=speculative(export.resolve(), s))
        with Engine(spec, log=log, startup_timeout_s=startup_timeout_s) as engine:
            for name, prompts in suites.items():
                for t in cfg.temperatures:
                    r = run(engine, serve.served_name, prompts, max_new, stop, conc, t, cfg.seed)
                    m = _speculative(r, plain[name] if t == 0 else None)
                    runs[name].setdefault(t, {})[s] = run_of(m, f"vLLM's run at num_steps {s}")
        startup[s] = engine.startup_s
    started = Startup(plain_startup, startup)
    info = EngineInfo("vllm", conc, serve.dtype, serve.enforce_eager, started)
    per_suite = {
        name: EngineSuite(r["outputs"], round(r["tokens"] / r["seconds"], 2), runs[name])
        for name, r in plain.items()
    }
    return info, per_suite


def _speculative(r: dict, plain: dict | None) -> dict:
    """A speculative run's metrics (run_of's fields); against the plain greedy run when it is
    greedy too."""
    m = r["counters"].summary()
    tps = r["tokens"] / r["seconds"]
    m["generated_tokens"] = r["tokens"]
    if plain is None:  # sampled: no reference text, tokens/s alone
        m["tokens_per_s"] = round(tps, 2)
        return m
    same = [a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True)]
    m.update(against_greedy(same, tps, plain["tokens"] / plain["seconds"]))
    return m


def measure_running(
    url: str, model: str, suites: dict[str, list[list[int]]], cfg: EvaluateSettings, stop: list[int]
) -> tuple[EngineInfo, dict[str, EngineSuite]]:
    """Every suite on an operator's engine already serving the drafter with `num_steps` draft
    tokens, at each temperature: acceptance from its counters. No plain run, so no greedy
    reference and no speedup."""
    (num_steps,) = cfg.num_steps
    max_new, conc = cfg.max_new_tokens, cfg.engine_concurrency
    per_suite = {}
    with Engine(url=url) as engine:
        for name, prompts in suites.items():
            runs: Runs = {}
            for t in cfg.temperatures:
                r = run(engine, model, prompts, max_new, stop, conc, t, cfg.seed)
                m = r["counters"].summary()
                if len(m["acceptance_rate"]) != num_steps:
                    raise EagletError(
                        f"{url}: the engine drafts {len(m['acceptance_rate'])} tokens a step "
                        f"(its num_speculative_tokens), evaluate.num_steps says {num_steps}"
                    )
                m.update(
                    generated_tokens=r["tokens"], tokens_per_s=round(r["tokens"] / r["seconds"], 2)
                )
                runs[t] = {num_steps: run_of(m, f"the engine's run at num_steps {num_steps}")}
            per_suite[name] = EngineSuite(None, None, runs)
    return EngineInfo("vllm", conc), per_suite


def engine_export(spec: Spec, setup: Setup) -> Path:
    """The drafter's current vLLM export, which `engine: vllm` serves."""
    if not setup.export.is_dir():
        raise EagletError(
            f"drafters.{spec.name}.evaluate.engine: vllm needs the vLLM export {setup.export} "
            f"(run: eaglet export {spec.name} --to vllm)"
        )
    return setup.export


def engine_metrics(
    spec: Spec,
    setup: Setup,
    prompts: dict[str, list[list[int]]],
    stop: set[int],
    cfg: EvaluateSettings,
    method: str = "eagle3",
) -> tuple[EngineInfo, dict[str, EngineSuite]]:
    """Every suite run by vLLM serving the target with the drafter's vLLM export (started here),
    or by an operator's engine already serving it (`engine_url`). `cfg`: `settings`'s."""
    target = setup.target
    if setup.engine_url:  # an operator's engine, already serving this drafter
        return measure_running(setup.engine_url, target.name, prompts, cfg, sorted(stop))
    longest = max(len(p) for ps in prompts.values() for p in ps) + cfg.max_new_tokens
    serve = ServeConfig.of(
        target,
        served_name=target.name,
        dtype=cfg.dtype,
        max_model_len=max(setup.target_max_length, longest),
        max_num_seqs=cfg.engine_concurrency,
        enforce_eager=cfg.engine_eager,
        tensor_parallel_size=cfg.engine_tensor_parallel_size,
        threads=setup.threads or 0,
        extra_args=cfg.engine_extra_args,
    )
    export = engine_export(spec, setup)
    return measure(serve, export, prompts, cfg, sorted(stop), method=method)
