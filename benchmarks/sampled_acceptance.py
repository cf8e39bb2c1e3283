"""Claim: vLLM's sampled acceptance of a drafter falls toward its greedy acceptance as the
temperature falls to 0 (at temperature 0.001 the target's distribution is one-hot on its argmax).

On a built demo (`make demo`), in one run: vLLM serving the target with the demo's vLLM export
(3 steps) answers the first 16 natural held-out prompts (96 new tokens, 16 in flight) greedy,
then seeded (request i: seed i, as eaglet's evaluation sends them) at each temperature, and once
at 0.7 without a seed; per run, the engine's /metrics counter deltas (accepted / proposed draft
tokens, acceptance length), as eaglet.stages.engine_eval reads them.

    .venv/bin/python benchmarks/sampled_acceptance.py [--params params.yaml] [--drafter demo]
        [--temperatures 0.001 0.3 0.7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eaglet.engines.vllm import Engine, ServeConfig, eagle3, spec_counters, target_stop_ids  # noqa: E402
from eaglet.formats.chat import prompt_ids  # noqa: E402
from eaglet.formats.io import read_jsonl  # noqa: E402
from eaglet.graph.keys import Keys  # noqa: E402
from eaglet.model.target import load_tokenizer, materialize, spec_of  # noqa: E402
from eaglet.params import load  # noqa: E402
from eaglet.stages import engine_eval  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.001, 0.3, 0.7])
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
                r = engine_eval.run(engine, "target", prompts, NEW_TOKENS, stop, PROMPTS, t, 0)
            else:
                r = unseeded(engine, prompts, stop, t)
            m = r["counters"].summary()
            table.append({"temperature": label, **m})
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": table}, indent=2))
    print("\n| temperature | accepted draft tokens / proposed | acceptance length |")
    print("|---|---|---|")
    for m in table:
        print(
            f"| {m['temperature']} | {m['accepted_tokens']:,} / {m['draft_tokens']:,} | "
            f"{m['acceptance_length']:.3f} |"
        )


if __name__ == "__main__":
    main()
