"""Claim: vLLM's sampled acceptance of a drafter is eaglet's own decoder's under the same rule
(argmax proposals, the standard rejection rule), at every temperature, and falls toward its
greedy acceptance as the temperature falls to 0. Before eaglet's vLLM plugin (which mends the
CPU build's `expand_kernel` stand-in) the CPU engine accepted almost nothing at any temperature.

On a built demo (`make demo`), in one run: vLLM serving the target with the demo's vLLM export
(3 steps) answers the first 16 natural held-out prompts (96 new tokens, 16 in flight) greedy,
then seeded (request i: seed i, as eaglet's evaluation sends them) at each temperature, and once
at 0.7 without a seed; per run, the engine's /metrics counter deltas (accepted / proposed draft
tokens, acceptance length), as eaglet.stages.evaluate.engine reads them. Beside each, eaglet's own
speculative decoding of the same prompts with the trained drafter (fp32), over `--seeds` seeds:
their mean and range. `VLLM_PLUGINS=none` runs the engine as it ships.

    .venv/bin/python -m benchmarks.sampled_acceptance [--params params.yaml] [--drafter demo]
        [--temperatures 0.01 0.3 0.7] [--seeds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.generate import target_stop_ids
from eaglet.engines.vllm.server import Engine
from eaglet.formats.chat import prompt_ids
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import read_jsonl
from eaglet.formats.speculative import eagle3, spec_counters
from eaglet.graph.keys import Keys
from eaglet.model import speculative
from eaglet.model.target import load_model, load_tokenizer, materialize, spec_of
from eaglet.params import load
from eaglet.stages.evaluate import engine as evaluate_engine

ROOT = Path(__file__).resolve().parents[1]

PROMPTS, NEW_TOKENS, STEPS = 16, 96, 3


def unseeded(engine: Engine, prompts: list[list[int]], stop: list[int], t: float) -> dict:
    """Every prompt once at temperature t without a seed: the counter deltas."""
    import httpx

    before = spec_counters(engine.metrics())
    with httpx.Client(base_url=engine.url, timeout=3600.0, trust_env=False) as http:
        for p in prompts:
            body = {"model": "target", "prompt": p, "max_tokens": NEW_TOKENS, "temperature": t}
            http.post("/v1/completions", json=body | {"stop_token_ids": stop}).raise_for_status()
    return {"counters": spec_counters(engine.metrics()) - before}


def own(target: speculative.Target, drafter, prompts, stop: list[int], t: float, seeds: int):
    """eaglet's decoder at temperature t (greedy at 0), one run per seed: 1 + accepted / rounds."""
    out = []
    for seed in range(seeds if t else 1):
        rule = speculative.Sampling(t, torch.Generator().manual_seed(seed)) if t else None
        runs = speculative.decode(
            target, prompts, NEW_TOKENS, set(stop), drafter, STEPS, None, rule
        )
        out.append(speculative.acceptance(runs, STEPS)["mean_acceptance_length"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.01, 0.3, 0.7])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    params = load(args.params)
    export = Keys(params).path("vllm", args.drafter)
    if not export.exists():
        sys.exit(f"{export}: not built (run make demo)")
    spec = spec_of(params)
    tok = load_tokenizer(spec)
    natural = params.resolve("data/heldout/natural.jsonl")
    rows = list(read_jsonl(natural))[:PROMPTS]
    prompts = [prompt_ids(tok, [{"role": "user", "content": r["instruction"]}]) for r in rows]
    stop = sorted(target_stop_ids(tok, materialize(spec)))
    serve = ServeConfig.of(
        spec,
        served_name="target",
        max_model_len=params.target["max_length"],
        max_num_seqs=PROMPTS,
        threads=args.threads,
        speculative=eagle3(export.resolve(), STEPS),
    )
    runs = [("0 (greedy)", 0.0, True)] + [(f"{t:g}, seeded", t, True) for t in args.temperatures]
    runs.append(("0.7, no seed", 0.7, False))
    table = []
    with Engine(serve) as engine:
        for label, t, seeded in runs:
            if seeded:
                r = evaluate_engine.run(engine, "target", prompts, NEW_TOKENS, stop, PROMPTS, t, 0)
            else:
                r = unseeded(engine, prompts, stop, t)
            table.append({"temperature": label, "t": t, **r["counters"].summary()})
    torch.set_num_threads(args.threads)
    drafter = load_drafter(Keys(params).path("train", args.drafter))
    target = speculative.Target(load_model(spec, "cpu", "float32"), list(drafter.cfg.aux_layer_ids))
    mine = {t: own(target, drafter, prompts, stop, t, args.seeds) for t in {m["t"] for m in table}}
    for m in table:
        m["eaglet"] = mine[m["t"]]
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": table}, indent=2))
    print("\n| temperature | vLLM: accepted / proposed | vLLM | eaglet, mean (range) |")
    print("|---|---|---|---|")
    for m in table:
        e = m["eaglet"]
        spread = f" ({min(e):.3f}-{max(e):.3f})" if len(e) > 1 else ""
        print(
            f"| {m['temperature']} | {m['accepted_tokens']:,} / {m['draft_tokens']:,} | "
            f"{m['acceptance_length']:.3f} | {sum(e) / len(e):.3f}{spread} |"
        )


if __name__ == "__main__":
    main()
