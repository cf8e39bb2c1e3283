"""Publish current numbers at stable paths for DVC's ledger (`dvc metrics diff`, `dvc plots`).

Keyed artifacts move with their keys; `metrics/` does not: it always describes what params.yaml
and the installed code build now. Snakemake runs this after every successful build.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.atomic import write_text
from eaglet.formats.io import write_json
from eaglet.graph.artifacts import scan
from eaglet.graph.keys import Keys
from eaglet.params import Params
from eaglet.reports import report

# The stats of each stage worth diffing between pipeline versions.
DATASET_METRICS = {
    "prompts": {"kept": "prompts"},
    "responses": {
        "responses": "responses",
        "completion_tokens": "completion_tokens",
        "cost": "cost_usd",
    },
    "hidden": {
        "tokens": "hidden_tokens",
        "loss_tokens": "loss_tokens",
        "bytes_per_token": "hidden_bytes_per_token",
    },
}


def dataset_metrics(keys: Keys) -> dict:
    out: dict[str, dict] = {ds: {} for ds in keys.params.datasets}
    for a in scan(keys):
        if a.state == "current" and a.stage in DATASET_METRICS:
            for stat, metric in DATASET_METRICS[a.stage].items():
                if stat in a.stats:
                    out[a.name][metric] = a.stats[stat]
    return out


def drafter_metrics(keys: Keys) -> dict[str, dict]:
    """Per drafter: the evaluation's headline numbers and the training's final ones."""
    out: dict[str, dict] = {d: {} for d in keys.params.drafters}
    for a in scan(keys):
        if a.state == "current" and a.stage == "evaluate":
            out[a.name].update(a.stats)
        if a.state == "current" and a.stage == "train":
            out[a.name]["train_final_loss"] = a.stats.get("final_loss")
            held = a.stats.get("heldout") or {}
            out[a.name]["heldout_acc"] = held.get("acc")
    return out


def publish(params: Params) -> list[Path]:
    """Write metrics/datasets.json, metrics/<drafter>.json, plots/<drafter>/train.csv and the
    report reports/<drafter>.html from the current artifacts; return the files written."""
    keys = Keys(params)
    path = params.root / "metrics" / "datasets.json"
    write_json(path, dataset_metrics(keys))
    written = [path]
    for drafter, metrics in drafter_metrics(keys).items():
        if metrics:
            written.append(params.root / "metrics" / f"{drafter}.json")
            write_json(written[-1], metrics)
        if "acceptance_length" in metrics:  # evaluated at its current key
            written.append(report.write(params, drafter))
        trained = keys.path("train", drafter) / "metrics.csv"
        if trained.exists():
            written.append(params.root / "plots" / drafter / "train.csv")
            write_text(written[-1], trained.read_text())
    return written
