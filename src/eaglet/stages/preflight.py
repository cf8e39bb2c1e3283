"""`eaglet generate --dry-run`: what a generation run would send and cost, checked against the
backend, without generating anything. Reporting only: no artifact's bytes come from here."""

from __future__ import annotations

import asyncio

from eaglet.formats.store import Store
from eaglet.graph.keys import resolve_stage
from eaglet.params import Params
from eaglet.stages.generate import scan


def preflight(params: Params, dataset: str) -> dict:
    """What `generate` would do, checked against the backend, without generating anything."""
    _, j = resolve_stage("responses", params, dataset)
    store = Store(j.store)
    try:
        now = scan(j, store)
        history = store.history(j.keyfn.backend)
        spent = store.totals()
    finally:
        store.close()
    report: dict = {"dataset": dataset, "backend": j.backend, "kind": j.kind, "store": now}
    if j.kind == "transformers":
        report["check"] = {"model": params.target["model"], "in_process": True}
    elif j.kind == "vllm" and not j.engine.get("url"):  # a dry run starts no engine
        report["check"] = {"model": params.target["model"], "managed": True}
    else:
        backend = j.generator()

        async def check() -> dict:
            try:
                return await backend.check()
            finally:
                await backend.close()

        report["check"] = asyncio.run(check())
    misses = now["failed"] + now["missing"]
    cap = j.sampling["max_new_tokens"]
    mean = history["mean_tokens"]
    report["requests"] = misses
    report["tokens"] = {
        "expected": round(misses * mean) if mean is not None else None,
        "max": misses * cap,
        "history_answers": history["answers"],
    }
    price = report["check"].get("price_per_token")
    if j.kind == "openai":
        prompt_tokens = now["missing_prompt_chars"] / 4  # a rough guess: ~4 characters a token
        hi = misses * cap * price["completion"] + prompt_tokens * price["prompt"] if price else None
        exp = misses * history["mean_cost"] if history["mean_cost"] is not None else None
        report["cost"] = {"expected": exp, "max": hi}
    budgets = []
    if j.token_budget is not None:
        budgets.append(("token_budget", j.token_budget, now["tokens"], mean or cap))
    if j.max_cost_usd is not None:
        per = history["mean_cost"] or (cap * price["completion"] if price else None)
        budgets.append(("max_cost_usd", j.max_cost_usd, now["cost"], per))
    if "token_budget" in j.overall:
        budgets.append(("budget.token_budget", j.overall["token_budget"], spent[0], mean or cap))
    if "max_cost_usd" in j.overall:
        per = history["mean_cost"]
        budgets.append(("budget.max_cost_usd", j.overall["max_cost_usd"], spent[1], per))
    report["budgets"] = [
        {
            "budget": name,
            "limit": limit,
            "used": used,
            "answers_left": int((limit - used) / per) if per else None,
            "stops_run": bool(per) and (limit - used) / per < misses,
        }
        for name, limit, used, per in budgets
    ]
    return report


def show(report: dict) -> None:
    """Print a preflight report for people."""
    s, c = report["store"], report["check"]
    lines = [f"dry run: responses {report['dataset']} via {report['backend']} ({report['kind']})"]
    if c.get("in_process"):
        lines.append(f"  backend: in-process transformers, target {c['model']}")
    elif c.get("managed"):
        lines.append(
            f"  backend: a vLLM engine eaglet starts for the run (target {c['model']}); not "
            "started by a dry run, so not checked"
        )
    else:
        served = {True: "served", False: "NOT served", None: "not listed"}[c.get("model_served")]
        lines.append(f"  backend: {c['url']} reachable; model {c.get('model')} {served}")
        if "key" in c:
            lines.append(f"  key: {c['key']}")
        if c.get("credit"):
            lim, rem = c["credit"]["limit"], c["credit"]["remaining"]
            lines.append(
                "  credit: unlimited" if rem is None else f"  credit: ${rem:.2f} left of ${lim:.2f}"
            )
    lines.append(
        f"  prompts: {s['prompts']}; in store: {s['ok']} answered, {s['failed']} failed; "
        f"requests to send: {report['requests']}"
    )
    t = report["tokens"]
    exp = f"~{t['expected']:,} (mean of {t['history_answers']} answers)" if t["expected"] else "?"
    lines.append(f"  completion tokens: expected {exp}, at most {t['max']:,}")
    if "cost" in report:
        co = report["cost"]
        exp = f"~${co['expected']:.4f}" if co["expected"] is not None else "unknown"
        hi = f"${co['max']:.4f}" if co["max"] is not None else "unknown (no price)"
        lines.append(f"  cost: expected {exp}, at most {hi}")
    for b in report["budgets"]:
        left = b["answers_left"]
        verdict = "stops this run" if b["stops_run"] else "does not stop this run"
        lines.append(
            f"  {b['budget']} {b['limit']}: used {b['used']:.6g}; "
            f"~{left if left is not None else '?'} answers left; {verdict}"
        )
    print("\n".join(lines))
