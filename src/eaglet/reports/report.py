"""`eaglet report DRAFTER`: one self-contained HTML page that judges a run at a glance.

Read from the drafter's current artifacts only: the evaluation's metrics.json and its PNG plots
(inlined as base64, so the page is one file that opens anywhere), the training's final numbers,
and the provenance: the evaluation's params and keys, the code version, and the data counts of every
dataset the drafter trains on. Every acceptance number is a table cell tagged with where it
comes from in metrics.json (`data-metric`), so a test can hold the page to the file.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path

from eaglet.atomic import write_text
from eaglet.errors import EagletError
from eaglet.formats.io import read_json
from eaglet.formats.metrics import (
    Metrics,
    Run,
    engine_json,
    read_metrics,
    steps_key,
    temperature_key,
)
from eaglet.graph.keys import Keys
from eaglet.params import Params

PLOTS = [
    ("suites.png", "Acceptance length per suite and temperature"),
    ("acceptance.png", "Acceptance rate per draft position"),
    ("loss.png", "Training curves"),
]
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%}pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
.note{color:#555;font-size:13px}
"""


def default_path(params: Params, drafter: str) -> Path:
    return params.root / "reports" / f"{drafter}.html"


def _num(value: object, metric: str) -> str:
    text = "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
    return f'<td class="n" data-metric="{html.escape(metric)}">{html.escape(text)}</td>'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(text: object) -> str:
    return f"<td>{html.escape(str(text))}</td>"


def runs(metrics: Metrics) -> list[tuple[str, str, float, int, Run]]:
    """(suite, who, temperature, num_steps, run) of every speculative run in metrics.json, who
    the engine (vllm) or eaglet."""
    out = []
    for suite, m in metrics.suites.items():
        for who, by_temperature in (("vllm", m.vllm or {}), ("eaglet", m.eaglet)):
            for t, by_steps in by_temperature.items():
                out += [(suite, who, t, n, r) for n, r in by_steps.items()]
    return out


def _acceptance(metrics: Metrics) -> str:
    rows = []
    for suite, who, t, n, r in runs(metrics):
        base = f"suites/{suite}/{who}/{temperature_key(t)}/{steps_key(n)}"  # its place in the file
        rates = ", ".join(f"{x:.2f}" for x in r.acceptance_rate)
        # 1 + accepted / rounds: the engine's acceptance length, eaglet's mean one
        same = "mean_acceptance_length" if who == "eaglet" else "acceptance_length"
        value = r.rounds.mean_acceptance_length if who == "eaglet" else r.acceptance_length
        rows.append(
            [
                _cell(suite),
                _cell("vLLM" if who == "vllm" else "eaglet"),
                _cell(f"{t:g}"),
                _cell(n),
                _num(r.acceptance_length, f"{base}/acceptance_length"),
                _num(value, f"{base}/{same}"),
                _cell(rates),
                _num(r.greedy.greedy_equal if r.greedy else "-", f"{base}/greedy_equal"),
                _num(r.tokens_per_s, f"{base}/tokens_per_s"),
                _num(r.greedy.speedup if r.greedy else None, f"{base}/speedup"),
            ]
        )
    header = ["suite", "decoder", "temperature", "steps", "acceptance length"]
    header += ["1 + accepted / rounds", "rate per position", "greedy equal", "tokens/s"]
    header += ["speedup"]
    offline = []
    for n, m in metrics.offline.items():
        rates = ", ".join(f"{x:.2f}" for x in m.acceptance_rate)
        al = _num(m.acceptance_length, f"offline/{steps_key(n)}/acceptance_length")
        offline.append([_cell(steps_key(n)), al, _cell(rates), _cell(m.positions)])
    prompts = [
        [_cell(s), _num(m.prompts, f"suites/{s}/prompts"), _cell(m.source)]
        for s, m in metrics.suites.items()
    ]
    return (
        "<h2>Acceptance</h2>"
        + _table(header, rows)
        + '<p class="note">acceptance length: vLLM counts 1 + accepted / drafts; eaglet counts '
        "tokens / rounds (its first token comes from the prefill); the next column is the same "
        "quantity for both.</p>"
        + "<h3>Suites</h3>"
        + _table(["suite", "prompts", "source"], prompts)
        + "<h3>Offline estimate (teacher-forced, the drafter's held-out split)</h3>"
        + _table(["num_steps", "acceptance length", "rate per position", "positions"], offline)
        + "".join(f'<p class="note">{html.escape(v)}</p>' for v in metrics.notes.values())
    )


def _data(keys: Keys, drafter: str) -> str:
    """The data counts of each dataset the drafter trains on, from their sidecars."""
    rows = []
    for ds in keys.params.drafter(drafter)["datasets"]:
        st = {}
        for stage in ("prompts", "responses", "hidden"):
            side = keys.sidecar(stage, ds)
            st[stage] = read_json(side).get("stats", {}) if side.exists() else {}
        rows.append(
            [
                _cell(ds),
                _num(st["prompts"].get("kept"), f"data/{ds}/prompts"),
                _num(st["responses"].get("responses"), f"data/{ds}/responses"),
                _num(st["responses"].get("completion_tokens"), f"data/{ds}/completion_tokens"),
                _num(st["hidden"].get("samples"), f"data/{ds}/hidden_samples"),
                _num(st["hidden"].get("tokens"), f"data/{ds}/hidden_tokens"),
            ]
        )
    header = ["dataset", "prompts", "responses", "completion tokens", "samples", "tokens"]
    return "<h2>Data</h2>" + _table(header, rows) + _regeneration(keys, drafter)


def _regeneration(keys: Keys, drafter: str) -> str:
    """Each dataset's regeneration checks: a count and the first record ids."""
    rows = []
    for ds in keys.params.drafter(drafter)["datasets"]:
        side = keys.sidecar("responses", ds)
        rep = (read_json(side).get("stats", {}) if side.exists() else {}).get("regeneration")
        for name, check in (rep or {}).items():
            value = f"{check['drift']:.2%}" if name == "token_drift" else check["count"]
            what = f" ({check['what']})" if "what" in check else ""
            first = ", ".join(check["first"])
            rows.append(
                [_cell(ds), _cell(name.replace("_", " ") + what), _cell(value), _cell(first)]
            )
    if not rows:
        return ""
    header = ["dataset", "check", "count", "first records"]
    return "<h2>Regenerated answers</h2>" + _table(header, rows)


def _image(folder: Path, name: str, title: str) -> str:
    path = folder / name
    if not path.exists():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<h3>{html.escape(title)}</h3><img alt="{name}" src="data:image/png;base64,{data}">'


def render(params: Params, drafter: str) -> str:
    """The page of the drafter's current evaluation."""
    keys = Keys(params)
    folder = keys.path("evaluate", drafter)
    if not (folder / "metrics.json").exists():
        raise EagletError(
            f"{folder}: drafter {drafter} is not evaluated at its current key "
            f"(run: snakemake --cores 2, or eaglet evaluate {drafter})"
        )
    metrics = read_metrics(folder / "metrics.json")
    prov = read_json(keys.sidecar("evaluate", drafter))["provenance"]
    trained = read_json(keys.sidecar("train", drafter)).get("stats", {})
    held = (trained.get("heldout") or {}).get("acc") or []
    train = _table(
        ["steps", "final loss", "held-out top-1 per TTT step", "seconds"],
        [[
            _num(trained.get("steps"), "train/steps"),
            _num(trained.get("final_loss"), "train/final_loss"),
            _cell(", ".join(f"{x:.3f}" for x in held)),
            _num(trained.get("elapsed_s"), "train/elapsed_s"),
        ]],
    )  # fmt: skip
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    engine = engine_json(metrics.engine) if metrics.engine is not None else None
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>eaglet: {drafter}</title>",
        f"<style>{STYLE}</style></head><body><h1>eaglet drafter <code>{drafter}</code></h1>",
        f"<p>Evaluation <code>{prov['key']}</code> (code v{prov.get('code_version')}), target "
        f"{html.escape(str(params.target['model']))}, {metrics.prompts} prompts, "
        f"greedy reference: {metrics.greedy_reference}; page written {when}.</p>",
        _acceptance(metrics),
        *(_image(folder, name, title) for name, title in PLOTS),
        "<h2>Training</h2>",
        train,
        _data(keys, drafter),
        "<h2>Provenance</h2><p>The evaluation's key inputs (params, upstream keys):</p>",
        f"<pre>{html.escape(json.dumps(prov, indent=2))}</pre>",
        f"<p>Engine: <code>{html.escape(json.dumps(engine, sort_keys=True))}</code></p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write(params: Params, drafter: str, out: Path | None = None) -> Path:
    """Render the page and write it atomically (default: reports/<drafter>.html)."""
    out = Path(out) if out else default_path(params, drafter)
    write_text(out, render(params, drafter))
    return out
