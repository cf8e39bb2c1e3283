"""`eaglet status`: what every artifact's current key is, whether it is built, and its stats."""

from __future__ import annotations

import json
import os

from eaglet.io import read_json
from eaglet.keys import STAGES, Keys
from eaglet.params import Params


def collect(params: Params) -> list[dict]:
    """One row per (stage, dataset): key, path, state and the stats of its sidecar."""
    keys = Keys(params)
    rows = []
    for ds in params.datasets:
        for stage in (s.name for s in STAGES.values() if s.kind == "dataset"):
            path = keys.path(stage, ds)
            sidecar = keys.sidecar(stage, ds)
            row = {
                "stage": stage,
                "dataset": ds,
                "key": keys.key(stage, ds),
                "path": os.path.relpath(path),
                "state": "built" if path.exists() else "missing",
            }
            if path.exists() and sidecar.exists():
                row["stats"] = read_json(sidecar).get("stats", {})
            if stage == "hidden" and path.is_dir():
                row["disk_bytes"] = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            rows.append(row)
    return rows


def _summary(row: dict) -> str:
    st = row.get("stats", {})
    if row["stage"] == "prompts" and st:
        return f"{st['kept']} prompts ({st['bad_rows']} bad rows, {st['duplicates']} duplicates)"
    if row["stage"] == "responses" and st:
        cost = f", ${st['cost']:.4f}" if st.get("cost") else ""
        return f"{st['responses']} responses, {st['completion_tokens']} completion tokens{cost}"
    if row["stage"] == "hidden" and st:
        per_token = row["disk_bytes"] / st["tokens"]
        return (
            f"{st['samples']} seqs, {st['tokens']} tok, {per_token:.0f} B/tok on disk "
            f"= {st['state_bytes_per_token']} x {per_token / st['state_bytes_per_token']:.3f}"
        )
    return ""


def show(params: Params, as_json: bool = False) -> None:
    rows = collect(params)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    width = max(len(r["dataset"]) for r in rows)
    for r in rows:
        print(
            f"{r['dataset']:<{width}}  {r['stage']:<9}  {r['key']}  {r['state']:<7}  "
            f"{_summary(r):<58}  {r['path']}"
        )
