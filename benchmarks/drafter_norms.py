"""Claim (to measure): EAGLE-3.1's norms (`arch` options, eaglet.model.drafter) change the demo
drafter's acceptance as stock vLLM serves it, by more than a seed does, or not.

On a built demo (`make demo`), for each seed and variant:
  1. the demo drafter retrained as its train stage does (train.fit with its hyperparameters, a
     draft vocab picked from its samples, as benchmarks/peer_speculators.py trains eaglet), the
     seed replaced, the variant's options set on its architecture; timed;
  2. its vLLM export (written and validated);
  3. per seed, every variant's export served by stock vLLM with the evaluate stage's settings
     (peer_speculators.serve_all: the CPU build, fp32, eager, the first suite's prompts, i.e.
     the demo's `data/heldout/natural.jsonl` first 16, 96 new tokens, greedy, its fewest
     num_steps, 3), after one plain greedy run whose text every output must equal; acceptance
     length = 1 + accepted / drafts and the rate per position from vLLM's /metrics counters.
Variants: EAGLE-3 (every option false), EAGLE-3.1 (fc_norm + norm_output, the paper's), and
speculators 0.9's defaults (norm_before_fc + norm_before_residual + norm_output). Results go to
WORK/results.json as they come (a rerun with the same --work skips what is there); the table at
the end: variant x seed, then per variant the mean and the spread over seeds.

    .venv/bin/python -m benchmarks.drafter_norms --params params.yaml [--seeds 0,1,2]
        [--variants eagle3,eagle3.1,speculators] [--epochs N] [--work DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import export_eaglet, fit_args, serve_all, train_eaglet
from eaglet.formats.drafter import load_drafter
from eaglet.model.target import load_config, materialize, spec_of
from eaglet.params import load
from eaglet.stages.hidden import read as hidden_read

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="a built demo")
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=", ".join(VARIANTS))
    ap.add_argument("--epochs", type=int, help="instead of the drafter's")
    ap.add_argument("--work", help="keep the drafters, exports and results here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="only the table of WORK/results.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    if args.report:
        table(json.loads((Path(args.work) / "results.json").read_text()), variants, seeds)
        return
    params = load(args.params)
    spec = spec_of(params)
    readers = hidden_read.open_readers(hidden_read.states(params, args.drafter))
    a = fit_args(params, args.drafter, readers)
    hp = a.pop("hp") | ({"epochs": args.epochs} if args.epochs else {})
    verifier = {"name_or_path": materialize(spec), "architectures": load_config(spec).architectures}
    work = Path(args.work or tempfile.mkdtemp(prefix="drafter-norms-"))
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    print(f"# work: {work}; hyperparameters: {json.dumps(hp, sort_keys=True)}", flush=True)

    for seed in seeds:
        exports = {}
        for v in variants:
            name = f"{v} seed {seed}"
            if "acceptance_length" in results.get(name, {}):
                continue
            out = work / f"{v}-seed{seed}"
            if name in results and (out / "trained").exists():  # trained, not yet served
                model = load_drafter(out / "trained")
            else:
                cfg = dataclasses.replace(a["cfg"], **VARIANTS[v])
                run = train_eaglet(a | {"cfg": cfg}, hp | {"seed": seed}, out)
                model, held = run["model"], run["stats"]["heldout"] or {}
                results[name] = {
                    "variant": v,
                    "seed": seed,
                    "options": VARIANTS[v],
                    "train_s": round(run["seconds"], 1),
                    "heldout_top1": held.get("acc"),
                }
                print(f"# {name}: trained in {run['seconds']:.1f} s, held-out top-1 "
                      f"{held.get('acc')}", flush=True)  # fmt: skip
            exports[name] = export_eaglet(model, verifier, out)
            saved.write_text(json.dumps(results, indent=2))
        if exports:
            t0 = time.perf_counter()
            served = serve_all(params, args.drafter, exports, args.threads, greedy_check=True)
            for name in exports:
                results[name] |= served[name]
            saved.write_text(json.dumps(results, indent=2))
            print(f"# seed {seed} served in {time.perf_counter() - t0:.0f} s", flush=True)
    table(results, variants, seeds)


def table(results: dict, variants: list[str], seeds: list[int]) -> None:
    print("\n| variant | seed | acceptance length | accepted per position (of drafts) | "
          "per position, given the one before | greedy equal | held-out top-1 per step | "
          "train time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        for s in seeds:
            r = results.get(f"{v} seed {s}", {})
            if "acceptance_length" not in r:
                print(f"| {v} | {s} | not measured | | | | | |")
                continue
            accepted = ", ".join(f"{x:.3f}" for x in r["accepted_per_position"])
            rates = ", ".join(f"{x:.3f}" for x in r["acceptance_rate"])
            top1 = ", ".join(f"{x:.3f}" for x in r["heldout_top1"] or [])
            print(
                f"| {v} | {s} | {r['acceptance_length']:.3f} ({r['drafts']} drafts) | {accepted} | "
                f"{rates} | "
                f"{r.get('greedy_equal')} | {top1} | {r['train_s']:.0f} s |"
            )
    print("\n| variant | seeds | acceptance length: mean (sd; min-max) | accepted per position: "
          "mean | held-out top-1 per step: mean | train time: mean |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for v in variants:
        rs = [results.get(f"{v} seed {s}", {}) for s in seeds]
        rs = [r for r in rs if "acceptance_length" in r]
        if not rs:
            continue
        al = [r["acceptance_length"] for r in rs]
        sd = statistics.stdev(al) if len(al) > 1 else 0.0
        per, top1 = (
            [statistics.mean(x) for x in zip(*(r[key] for r in rs), strict=True)]
            for key in ("accepted_per_position", "heldout_top1")
        )
        print(
            f"| {v} | {len(rs)} | {statistics.mean(al):.3f} ({sd:.3f}; {min(al):.3f}-{max(al):.3f})"
            f" | {', '.join(f'{x:.3f}' for x in per)} | {', '.join(f'{x:.3f}' for x in top1)} | "
            f"{statistics.mean(r['train_s'] for r in rs):.0f} s |"
        )


if __name__ == "__main__":
    main()
