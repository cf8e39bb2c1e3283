"""Claim: hidden.mode online trades the hidden states' disk for an engine prefill every epoch,
and hybrid pays that prefill once; the three modes train drafters of the same held-out accuracy.

Side by side in one run, on the embedded target (SmolLM2, fp32; the vLLM CPU engine for every
mode unless --offline-backend transformers)
and a small demo-sized project (two demo prompt files, short answers from the in-process
target): per mode, the wall time of `eaglet hidden` (every dataset) and of `eaglet train`
(engine start included where the mode needs one), the bytes under data/hidden, and the trained
drafter's held-out top-1 accuracy per TTT step. Hybrid is then trained a second time (another
seed) to show a run that reads only its cache.

    .venv/bin/python -m benchmarks.hidden_modes [--sg 24] [--dolly 16] [--new-tokens 48]
        [--epochs 3] [--offline-backend vllm|transformers] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from eaglet.formats.io import read_json
from eaglet.graph.keys import Keys
from eaglet.params import load

ROOT = Path(__file__).resolve().parents[1]

DATASETS = ("sg", "dolly")


def params(root: Path, mode: str, args: argparse.Namespace, seed: int = 0) -> Path:
    data = {
        "target": {"model": "smollm2-135m-instruct", "max_length": 512},
        "backends": {"local": {"kind": "transformers", "batch_size": 8, "threads": 2}},
        "generation": {"backend": "local", "max_new_tokens": args.new_tokens, "temperature": 0.0},
        "datasets": {
            "sg": {
                "path": "data/demo/sharegpt.jsonl",
                "format": "sharegpt",
                "max_samples": args.sg,
            },
            "dolly": {
                "path": "data/demo/dolly.jsonl",
                "format": "dolly",
                "max_samples": args.dolly,
            },
        },
        "hidden": {
            "backend": args.offline_backend if mode == "offline" else "vllm",
            "mode": mode,
            "dtype": "float32",
            "compute_dtype": "float32",
            "threads": 2,
            "concurrency": 8,
        },
        "drafters": {
            "d": {
                "datasets": list(DATASETS),
                "draft_vocab_size": 1024,
                "heldout_fraction": 0.2,
                "train": {
                    "ttt_length": 3,
                    "epochs": args.epochs,
                    "batch_size": 4,
                    "lr": 1e-3,
                    "seed": seed,
                },
            }
        },
    }
    path = root / f"{mode}-{seed}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def eaglet(params_file: Path, *args: str) -> tuple[float, str]:
    """Seconds the command took, and its last stderr line from the online reader (if any)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "eaglet", *args, "--params", str(params_file)],
        capture_output=True,
        text=True,
        env=env,
        cwd=params_file.parent,
    )
    if r.returncode:
        sys.exit(f"eaglet {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    said = [
        line for line in r.stderr.splitlines() if line.startswith("hidden ") and "engine" in line
    ]
    return time.monotonic() - t0, said[-1] if said else ""


def disk(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        for base in (p, p.with_name(p.name + ".cache")):
            if base.exists():
                total += sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
    return total


def run_mode(root: Path, mode: str, args: argparse.Namespace, seed: int = 0) -> dict:
    file = params(root, mode, args, seed)
    keys = Keys(load(file))
    hidden_s = 0.0 if seed else sum(eaglet(file, "hidden", ds, "--quiet")[0] for ds in DATASETS)
    if not seed:
        eaglet(file, "vocab", "d")
    train_s, states_from = eaglet(file, "train", "d", "--quiet")
    stats = read_json(keys.sidecar("train", "d"))["stats"]
    return {
        "mode": mode if not seed else f"{mode} (second run)",
        "hidden_s": round(hidden_s, 1),
        "train_s": round(train_s, 1),
        "total_s": round(hidden_s + train_s, 1),
        "hidden_disk_bytes": disk([keys.path("hidden", ds) for ds in DATASETS]),
        "heldout_acc": [round(a, 4) for a in stats["heldout"]["acc"]],
        "heldout_positions": stats["heldout"]["positions"],
        "states_from": states_from or "shards",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sg", type=int, default=24)
    ap.add_argument("--dolly", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--offline-backend",
        choices=["vllm", "transformers"],
        default="vllm",
        help="the offline hidden stage's engine (transformers: no engine start, same fp32 states)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eaglet-modes-") as tmp:
        root = Path(tmp)
        shutil.copytree(ROOT / "data" / "demo", root / "data" / "demo")
        first = params(root, "offline", args)
        for ds in DATASETS:  # the responses are shared: the hidden key alone moves with mode
            eaglet(first, "prompts", ds)
            eaglet(first, "generate", ds, "--quiet")
        rows = [run_mode(root, m, args) for m in ("offline", "online", "hybrid")]
        rows.append(run_mode(root, "hybrid", args, seed=1))
    report = {"date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": None}, "rows": rows}
    print(json.dumps(report, indent=2))
    print("\n| mode | hidden stage s | train s | total s | hidden disk | held-out top-1 | states |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{a:.3f}" for a in r["heldout_acc"])
        mb = r["hidden_disk_bytes"] / 2**20
        print(
            f"| {r['mode']} | {r['hidden_s']} | {r['train_s']} | {r['total_s']} | "
            f"{mb:.1f} MiB | {acc} | {r['states_from']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
