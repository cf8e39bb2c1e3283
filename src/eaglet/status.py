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
    for d in params.drafters:
        for stage in (s.name for s in STAGES.values() if s.kind == "drafter"):
            path = keys.path(stage, d)
            sidecar = keys.sidecar(stage, d)
            row = {
                "stage": stage,
                "drafter": d,
                "key": keys.key(stage, d),
                "path": os.path.relpath(path),
                "state": "built" if path.exists() else "missing",
            }
            if path.exists() and sidecar.exists():
                row["stats"] = read_json(sidecar).get("stats", {})
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
    if row["stage"] == "vocab" and st:
        return f"{st['draft_vocab_size']} ids, {100 * st['coverage']:.1f}% of assistant tokens"
    if row["stage"] == "train" and st:
        acc = (st.get("heldout") or {}).get("acc") or [float("nan")]
        return f"{st['steps']} steps, loss {st['final_loss']:.3f}, held-out acc@0 {acc[0]:.2f}"
    if row["stage"] == "evaluate" and st:
        als = [f"{v:.2f}" for k, v in st.items() if k.startswith("acceptance_length_") and v]
        eq = all(v for k, v in st.items() if k.startswith("greedy_equal_"))
        return f"acceptance length {' / '.join(als)}, greedy equal: {eq}"
    return ""


def show(params: Params, as_json: bool = False) -> None:
    rows = collect(params)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    width = max(len(r.get("dataset") or r["drafter"]) for r in rows)
    for r in rows:
        name = r.get("dataset") or r["drafter"]
        print(
            f"{name:<{width}}  {r['stage']:<9}  {r['key']}  {r['state']:<7}  "
            f"{_summary(r):<58}  {r['path']}"
        )
