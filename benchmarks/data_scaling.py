"""Claim: the demo drafter's acceptance is limited by how much data it trains on.

On a built demo (`make demo`), in one run:
  0. the target's greedy answers to the drafter's held-out prompt file
     (the first `evaluate.suites` file, written apart from the training data) and their hidden
     states, built in a temporary project with the demo's target, backend and storage;
  1. the drafter retrained as its train stage does (its hyperparameters and seed, a draft vocab
     picked from what it trains on) on a seeded share of its training samples, for each --runs
     entry `SHARE` or `SHARE:EPOCHS`; the split's held-out samples stay in every share;
  2. each drafter's offline acceptance on those held-out hidden states
     (eaglet.stages.evaluate.kernel.offline: the teacher-forced chain from every answer position),
     next to the demo's own drafter measured the same way and the engine's number from its
evaluation. Then a fit of acceptance length against log(answer tokens) over the runs at the demo's
epochs, and the tokens it puts at acceptance length 2.0 (an extrapolation: read it as an order of
magnitude).

    .venv/bin/python -m benchmarks.data_scaling [--params params.yaml] [--drafter demo]
        [--runs 0.25,0.5,1,1:6] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

import torch
import yaml

from benchmarks.common import fit_args, pressure
from eaglet.formats.drafter import load_drafter
from eaglet.formats.hidden_store import HiddenReader
from eaglet.formats.metrics import offline_json, read_metrics
from eaglet.graph.keys import Keys, build
from eaglet.params import load
from eaglet.stages.evaluate import kernel as evaluate_kernel
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.train.spec import TrainHyper

ROOT = Path(__file__).resolve().parents[1]


class Share:
    """A hidden-states reader restricted to some of its sample ids (what training reads)."""

    def __init__(self, reader: HiddenReader, ids: list[str]):
        self.reader, self.ids, self.manifest = reader, ids, reader.manifest

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return (self.reader.get(i) for i in self.ids)

    def get(self, id: str) -> dict:
        return self.reader.get(id)


def share(readers: list, fraction: float, heldout_fraction: float, seed: int = 0) -> list[Share]:
    """`fraction` of each reader's training samples (seeded), plus all of its held-out ones."""
    out = []
    for r in readers:
        held = [s for s in r.ids if hidden_read.is_heldout(s, heldout_fraction)]
        train_ids = [s for s in r.ids if not hidden_read.is_heldout(s, heldout_fraction)]
        keep = set(random.Random(seed).sample(train_ids, round(len(train_ids) * fraction)))
        out.append(Share(r, [s for s in r.ids if s in keep or s in held]))
    return out


def heldout_states(params, drafter: str, folder: Path, threads: int) -> HiddenReader:
    """Answers and hidden states of the drafter's held-out prompt file, built in `folder`."""
    d = params.drafter(drafter)
    file = next(s for s in d["evaluate"]["suites"].values() if "path" in s)
    data = {k: params.data[k] for k in ("target", "backends", "generation", "prompts", "hidden")}
    data["datasets"] = {
        "heldout": {
            "path": str(params.resolve(file["path"])),
            "format": file["format"],
            "max_new_tokens": d["evaluate"]["max_new_tokens"],
        }
    }
    (folder / "params.yaml").write_text(yaml.safe_dump(data))
    p = load(folder / "params.yaml")
    build("prompts", p, "heldout")
    build("responses", p, "heldout", threads=threads, quiet=True)
    return HiddenReader(build("hidden", p, "heldout", threads=threads, quiet=True))


def answer_tokens(readers: list, refs: list) -> int:
    return sum(int(readers[i].get(s)["loss_mask"].sum()) for i, s in refs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="a built demo")
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--runs", default="0.25,0.5,1,1:6", help="SHARE or SHARE:EPOCHS, ...")
    ap.add_argument("--steps", type=int, default=3, help="draft steps of the acceptance")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load(args.params)
    keys = Keys(params)
    readers = hidden_read.open_readers(hidden_read.states(params, args.drafter))
    heldout_fraction = params.drafter(args.drafter)["heldout_fraction"]
    base = fit_args(params, args.drafter, readers)
    print(f"# cpu pressure before: {pressure()}", flush=True)

    def accept(model) -> dict:
        m = evaluate_kernel.offline(model, [held], refs, base["tensors"]["lm_head"], [args.steps])
        return offline_json(m[args.steps])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        held = heldout_states(params, args.drafter, Path(tmp), args.threads)
        refs = [(0, s) for s in held.ids]
        trained = keys.path("train", args.drafter)
        if trained.exists():
            rows.append({"run": "the demo's drafter", **accept(load_drafter(trained))})
            evaluated = keys.path("evaluate", args.drafter) / "metrics.json"
            if evaluated.exists():
                suite = next(iter(read_metrics(evaluated).suites.values()))
                greedy = (suite.vllm or {}).get(0, {}).get(args.steps)
                al = greedy.acceptance_length if greedy else None
                rows[-1]["engine_acceptance_length"] = al
        for run in args.runs.split(","):
            fraction, _, epochs = run.partition(":")
            sub = share(readers, float(fraction), heldout_fraction)
            a = fit_args(params, args.drafter, sub)
            hp = a.pop("hp") | ({"epochs": int(epochs)} if epochs else {})
            train_refs, _ = hidden_read.split(sub, heldout_fraction)
            st = train_kernel.fit(
                **a, hp=TrainHyper.of(hp), out=Path(tmp) / run, checkpoint_every=10**9, quiet=True
            )
            rows.append(
                {
                    "run": f"share {fraction}, {hp['epochs']} epochs",
                    "share": float(fraction),
                    "epochs": hp["epochs"],
                    "answer_tokens": answer_tokens(sub, train_refs),
                    "steps": st["steps"],
                    "split_top1": [round(x, 3) for x in st["heldout"]["acc"]],
                    "train_s": st["elapsed_s"],
                    **accept(load_drafter(Path(tmp) / run)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"# cpu pressure after: {pressure()}")
    suites = params.drafter(args.drafter)["evaluate"]["suites"]
    source = next(s["path"] for s in suites.values() if "path" in s)
    print(f"# held-out: the target's answers to the {len(refs)} prompts of {source}")
    print("\n| run | answer tokens | split top-1 | acceptance length | per position |")
    print("|---|---|---|---|---|")
    for r in rows:
        rates = ", ".join(f"{x:.2f}" for x in r["acceptance_rate"])
        al = f"{r['acceptance_length']:.3f}"
        if r.get("engine_acceptance_length"):
            al += f" (engine on its prompts: {r['engine_acceptance_length']:.3f})"
        split = ", ".join(map(str, r.get("split_top1", [])))
        print(f"| {r['run']} | {r.get('answer_tokens', '')} | {split} | {al} | {rates} |")
    epochs = params.drafter(args.drafter)["train"]["epochs"]
    fit = [r for r in rows if r.get("epochs") == epochs and r["share"] > 0]
    if len(fit) >= 2:
        xs = [math.log(r["answer_tokens"]) for r in fit]
        ys = [r["acceptance_length"] for r in fit]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        need = math.exp(mx + (2.0 - my) / slope) if slope > 0 else float("inf")
        print(
            f"\nacceptance length = {my:.3f} + {slope:.3f} * ln(tokens / {math.exp(mx):,.0f}) "
            f"at {epochs} epochs: 2.0 at about {need:,.0f} answer tokens "
            f"({need / max(r['answer_tokens'] for r in fit):.0f}x the most here)"
        )


if __name__ == "__main__":
    main()
