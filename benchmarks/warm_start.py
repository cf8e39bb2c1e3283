"""Claims (to measure): a drafter continued from the demo drafter (`train.init_from`) for one
epoch on new data is accepted more often by stock vLLM than one trained from scratch on the
same data for the same time (the same steps); and the demo drafter with its checkpoint chosen by
offline acceptance (`train.select`) against the demo's own (the last epoch).

On a built demo (`make demo`), through the graph itself (params, snakemake, the evaluate stage):
  1. an overlay of the demo's params (written beside it, `extends: params.yaml`) adds a dataset
     of new requests (`--new`, the first `--samples` of `data/demo/instructions.jsonl`: templated
     instructions, another distribution than the demo's questions), answered by the demo's
     engine, and per seed two drafters on it alone: `warm` (init_from the demo drafter's current
     train folder) and `cold` (from scratch), both with the demo's hyperparameters and 1 epoch,
     each with its own draft vocabulary (picked from the new data: the warm start maps the demo
     drafter's lm_head rows onto it);
  2. `snakemake --config params=OVERLAY` builds them; each drafter's evaluate stage serves its
     vLLM export in stock vLLM (the demo's suites: natural held-out prompts and HumanEval, greedy
     and at 0.7) and reads acceptance from vLLM's counters;
  3. `demo_selected`: the demo drafter's params with `select: {by: offline_acceptance}`;
  4. the table: drafter, seed, train time and steps, held-out top-1, acceptance per suite and
     temperature; the demo drafter itself (trained on the demo's questions, 4 epochs) as the
     first row.

    .venv/bin/python -m benchmarks.warm_start [--params params.yaml] [--samples 240]
        [--seeds 0] [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import engine_acceptance
from eaglet.formats.io import read_json
from eaglet.graph.keys import Keys
from eaglet.params import load

ROOT = Path(__file__).resolve().parents[1]

OVERLAY = "warm_start.bench.yaml"


def overlay(params_path: Path, new: str, samples: int, seeds: list[int]) -> dict:
    params = load(params_path)
    demo = params.drafter("demo")
    base = Keys(params).path("train", "demo")
    if not base.exists():
        raise SystemExit(f"{base}: the demo drafter is not built (make demo)")
    train = {k: demo["train"][k] for k in ("ttt_length", "lr")} | {"epochs": 1}
    drafter = {
        "datasets": ["new_requests"],
        "draft_vocab_size": demo["draft_vocab_size"],
        "evaluate": demo["evaluate"],
    }
    drafters = {}
    for seed in seeds:
        warm_from = os.path.relpath(base, params_path.parent)
        drafters[f"warm_s{seed}"] = drafter | {
            "train": train | {"seed": seed, "init_from": warm_from}
        }
        drafters[f"cold_s{seed}"] = drafter | {"train": train | {"seed": seed}}
    drafters["demo_selected"] = {
        "datasets": demo["datasets"],
        "draft_vocab_size": demo["draft_vocab_size"],
        "train": demo["train"] | {"select": {"by": "offline_acceptance", "num_steps": 3}},
        "evaluate": demo["evaluate"],
    }
    return {
        "extends": params_path.name,
        "datasets": {"new_requests": {"path": new, "format": "alpaca", "max_samples": samples}},
        "drafters": drafters,
    }


def row(keys: Keys, name: str) -> str:
    st = read_json(keys.sidecar("train", name))["stats"]
    warm, sel = st.get("init_from"), st.get("selected")
    start = f"demo drafter ({warm['rows_copied']}/{warm['draft_vocab']} rows)" if warm else "-"
    if sel:
        curve = ", ".join(f"{x:.3f}" for x in sel["curve"])
        start += f"; kept epoch {sel['epoch'] + 1} (offline acceptance by epoch {curve})"
    top1 = (st.get("heldout") or {}).get("acc") or []
    return (
        f"| {name} | {start} | {st['steps']} | {st['elapsed_s']:.0f} s | "
        f"{', '.join(f'{x:.3f}' for x in top1)} | {engine_acceptance(keys, name)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="a built demo")
    ap.add_argument("--new", default="data/demo/instructions.jsonl")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    params_path = Path(args.params).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    path = params_path.parent / OVERLAY
    path.write_text(json.dumps(overlay(params_path, args.new, args.samples, seeds), indent=2))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", str(args.cores), "--config",
         f"params={OVERLAY}"],
        cwd=params_path.parent,
        check=True,
    )  # fmt: skip
    print(f"# built in {time.perf_counter() - t0:.0f} s; overlay {path}", flush=True)
    keys = Keys(load(path))
    print("\n| drafter | started from | steps | train time | held-out top-1 per step | "
          "vLLM acceptance length (per num_steps) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(row(keys, "demo"))
    print(row(keys, "demo_selected"))
    for seed in seeds:
        for kind in ("warm", "cold"):
            print(row(keys, f"{kind}_s{seed}"))


if __name__ == "__main__":
    main()
