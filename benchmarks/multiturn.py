"""Claim (to measure): on multi-turn conversations, regenerating and supervising every assistant
turn (`turns: all`) gives a drafter that stock vLLM accepts more often on held-out multi-turn
prompts than supervising the last turn only (`turns: last`), at equal generation budget.

Through the graph itself, in a work folder (the repository's Snakefile and rules, the demo's
target, engine and hyperparameters, a params file of its own):
  1. MT-Bench's 80 two-turn questions (`data/heldout/mtbench.jsonl`, from their source): the
     target answers turn 1 (`eaglet generate mtbench_t1`, the demo's engine and sampling), and
     two held-out suites are written from them: `mtbench_t1` (turn 1) and `mtbench_t2` (turn 2
     after the target's own turn-1 answer: the context it sees when served);
  2. two datasets on the same conversations (`data/demo/multiturn.jsonl`: 173 OpenAssistant
     conversations of 2-3 user turns, data/README.md), the same completion-token budget each
     (`--budget`): `all` (every turn, each after the target's own answers) and `last` (the last
     turn after the dataset's history); a drafter on each, the demo's hyperparameters and draft
     vocabulary size, its own seed-fixed vocabulary;
  3. `snakemake` builds both and evaluates each in stock vLLM on both suites, greedy;
  4. the table: conversations and turns supervised, supervised tokens per conversation, hidden
     tokens, train time, held-out top-1, vLLM acceptance length per suite and temperature.

    .venv/bin/python -m benchmarks.multiturn --work DIR [--budget 12000] [--prompts 40]
        [--seed 0] [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.common import engine_acceptance
from eaglet.formats.io import read_json, read_jsonl
from eaglet.graph.keys import Keys
from eaglet.params import load

ROOT = Path(__file__).resolve().parents[1]

COPY = ["Snakefile", "rules", "envs", "dvc.yaml"]
MTBENCH = ROOT / "data" / "heldout" / "mtbench.jsonl"
CONVERSATIONS = ROOT / "data" / "demo" / "multiturn.jsonl"


def params(budget: int, prompts: int, seed: int) -> dict:
    demo = load(ROOT / "params.yaml")
    d = demo.drafter("demo")
    suites = {
        s: {"path": f"data/heldout/{s}.jsonl", "format": "ultrachat"}
        for s in ("mtbench_t1", "mtbench_t2")
    }
    drafters = {
        ds: {
            "datasets": [ds],
            "draft_vocab_size": d["draft_vocab_size"],
            "train": {k: d["train"][k] for k in ("ttt_length", "epochs", "lr")} | {"seed": seed},
            # greedy only: vLLM's CPU build stops its engine on a seeded sampled request whose
            # prompt is prefilled in chunks (gpu_model_runner: `CPU Generator does not use
            # offset`), which MT-Bench's turn-2 prompts are
            "evaluate": {k: v for k, v in d["evaluate"].items() if k != "suites"}
            | {"prompts": prompts, "suites": suites, "temperatures": [0]},
        }
        for ds in ("all", "last")
    }
    conv = {"path": "data/demo/multiturn.jsonl", "format": "sharegpt", "token_budget": budget}
    return {
        "target": demo.data["target"],
        "backends": demo.data["backends"],
        "generation": dict(demo.data["generation"]),
        "datasets": {
            "all": conv | {"turns": "all"},
            "last": conv | {"turns": "last"},
            "mtbench_t1": {"path": "data/heldout/mtbench_turn1.jsonl", "format": "ultrachat"},
        },
        "drafters": drafters,
    }


def run(work: Path, *cmd: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(cmd, cwd=work, env=env, check=True)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def mtbench() -> list[dict]:
    return [json.loads(line) for line in MTBENCH.read_text().splitlines() if line.strip()]


def suites(work: Path, keys: Keys) -> None:
    """The two MT-Bench suites: turn 1, and turn 2 after the target's own turn-1 answer."""
    questions = {q["turns"][0]: q for q in mtbench()}
    t1, t2 = [], []
    for rec in read_jsonl(keys.path("responses", "mtbench_t1")):
        first = rec["messages"][-1]["content"]
        q = questions[first]
        answer = {"role": "assistant", "content": rec["response"]}
        t1.append({"messages": [{"role": "user", "content": first}]})
        t2.append(
            {"messages": [*t1[-1]["messages"], answer, {"role": "user", "content": q["turns"][1]}]}
        )
    for name, rows in (("mtbench_t1", t1), ("mtbench_t2", t2)):
        write_jsonl(work / "data" / "heldout" / f"{name}.jsonl", rows)


def row(keys: Keys, name: str) -> str:
    resp = read_json(keys.sidecar("responses", name))["stats"]
    hid = read_json(keys.sidecar("hidden", name))["stats"]
    st = read_json(keys.sidecar("train", name))["stats"]
    top1 = (st.get("heldout") or {}).get("acc") or []
    convs = resp["conversations"]
    return (
        f"| {name} | {convs} | {resp['responses']} | {resp['completion_tokens']:,} | "
        f"{hid['loss_tokens'] / convs:.0f} | {hid['tokens']:,} ({hid['samples']} samples) | "
        f"{st['steps']} | {st['elapsed_s']:.0f} s | {', '.join(f'{x:.3f}' for x in top1)} | "
        f"{engine_acceptance(keys, name)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--work", required=True, help="the project folder (kept; reruns build what is missing)"
    )
    ap.add_argument("--budget", type=int, default=12000, help="completion tokens per dataset")
    ap.add_argument("--prompts", type=int, default=40, help="prompts per suite")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    for name in COPY:
        src, dst = ROOT / name, work / name
        if not dst.exists():
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    (work / "data" / "demo").mkdir(parents=True, exist_ok=True)
    shutil.copy(CONVERSATIONS, work / "data" / "demo" / "multiturn.jsonl")
    first = [{"messages": [{"role": "user", "content": q["turns"][0]}]} for q in mtbench()]
    (work / "data" / "heldout").mkdir(parents=True, exist_ok=True)
    write_jsonl(work / "data" / "heldout" / "mtbench_turn1.jsonl", first)
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(params(args.budget, args.prompts, args.seed), sort_keys=False))
    t0 = time.perf_counter()
    py = sys.executable
    run(work, py, "-m", "eaglet", "prompts", "mtbench_t1")
    run(work, py, "-m", "eaglet", "generate", "mtbench_t1", "--quiet")
    suites(work, Keys(load(path)))
    run(work, py, "-m", "snakemake", "--cores", str(args.cores))
    print(f"# built in {time.perf_counter() - t0:.0f} s; project {work}", flush=True)
    keys = Keys(load(path))
    print("\n| turns | conversations | turns supervised | completion tokens | supervised tokens "
          "per conversation | hidden tokens | steps | train time | held-out top-1 per step | "
          "vLLM acceptance length (per num_steps) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("all", "last"):
        print(row(keys, name))


if __name__ == "__main__":
    main()
