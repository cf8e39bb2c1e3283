"""`eaglet generate --dry-run`: what a generation run would send and cost, checked against the
backend, without generating anything. Reporting only: no artifact's bytes come from here.

A dry run loads no model and starts no engine. It checks what it can without them: the params
(validated on load), the dataset's prompts (built), the store, a server an operator runs
(reachable, model served), an API's key (set in the environment, accepted) and credit, and the
target's tokenizer and chat template where they load without the model (a folder, a hub id; the
built-in GGUF once de-quantized). What only a loaded model can show (a vLLM engine eaglet starts,
the in-process target, the built-in GGUF's first de-quantization) is one `not checked:` line
each, saying what the run does instead.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.store import Store
from eaglet.graph.keys import resolve_stage
from eaglet.params import Params
from eaglet.stages.responses.job import Job
from eaglet.stages.responses.run import scan, spend_lines, spend_report


def preflight(params: Params, dataset: str) -> dict:
    """What `generate` would do, checked against the backend, without generating anything."""
    _, j = resolve_stage("responses", params, dataset)
    store = Store(j.store)
    try:
        now = scan(j, store)
        history = store.history(j.keyfn.backend)
        spend = spend_report(j.params_name, j.spend_count, store)
    finally:
        store.close()
    not_checked: list[str] = []
    report: dict = {"dataset": dataset, "backend": j.backend, "kind": j.kind, "store": now}
    report["check"] = check_backend(j, not_checked)
    report["tokenizer"] = check_tokenizer(j, not_checked)
    report["not_checked"] = not_checked
    misses = now["failed"] + now["missing"]
    cap = j.sampling["max_new_tokens"]
    mean = history["mean_tokens"]
    report["requests"] = misses
    report["tokens"] = {
        "expected": min(round(misses * mean), misses * cap) if mean is not None else None,
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
    used = spend["charged"]
    if "token_budget" in j.caps:
        budgets.append(("budget.token_budget", j.caps["token_budget"], used["tokens"], mean or cap))
    if "max_cost_usd" in j.caps:
        per = history["mean_cost"]
        budgets.append(("budget.max_cost_usd", j.caps["max_cost_usd"], used["cost"], per))
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
    report["spend"] = spend
    return report


def check_backend(j: Job, not_checked: list[str]) -> dict:
    """The backend, as far as it can be checked without loading the target or starting an
    engine; what cannot be is added to `not_checked`."""
    run = f"`eaglet generate {j.dataset}`"
    if j.kind == "transformers":
        device = j.engine.get("device", "auto")
        not_checked.append(
            f"the in-process target ({j.target.name}, transformers, device {device}) is not "
            f"loaded by --dry-run; {run} loads it"
        )
        return {"model": j.target.name, "in_process": True}
    if j.kind == "vllm" and not j.engine.get("url"):
        found = importlib.util.find_spec("vllm")  # locates the package, imports nothing
        if found is None:
            raise EagletError(
                f"backends.{j.backend}: kind vllm starts a vLLM engine, and vllm is not "
                f"installed for {sys.executable}"
            )
        not_checked.append(
            f"the managed vLLM engine is not started by --dry-run (it loads {j.target.name}); "
            f"{run} starts it, waiting up to startup_timeout_s "
            f"{j.engine.get('startup_timeout_s', '?')} s, and stops if it fails"
        )
        return {"model": j.target.name, "managed": True, "vllm": found.origin}
    if j.kind == "vllm":
        return _vllm_server(j.engine["url"])
    if j.kind == "sglang":  # the backend without its tokenizer: check() only sends two GETs
        from eaglet.engines.sglang import SGLangBackend

        backend = SGLangBackend(j.backend, j.engine, None, j.target.name)
    else:
        backend = j.generator()  # openai: the key must be set; its tokenizer loads on use

    async def check() -> dict:
        try:
            return await backend.check()
        finally:
            await backend.close()

    return asyncio.run(check())


def _vllm_server(url: str) -> dict:
    """A vLLM server an operator runs: healthy, and the model it serves (the run asks the
    first one it lists)."""
    import httpx

    from eaglet.engines.http import unreachable

    url = url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=30.0, trust_env=False)
        r = httpx.get(f"{url}/v1/models", timeout=30.0, trust_env=False)
    except httpx.HTTPError as e:
        raise unreachable(url, e) from None
    if health.status_code != 200:
        raise EagletError(f"{url}: /health answered HTTP {health.status_code}")
    try:
        served = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
    except ValueError:
        served = []
    if not served:
        raise EagletError(f"{url}: serves no model (GET /v1/models)")
    return {"url": url, "model": served[0], "model_served": True}


def check_tokenizer(j: Job, not_checked: list[str]) -> dict | None:
    """The target's tokenizer and chat template, loaded as the run loads them and made to
    render the dataset's first prompt in its mode; unless loading them needs the model (the
    built-in GGUF not yet de-quantized): then a `not_checked` line."""
    from eaglet.formats.chat import prompt_ids
    from eaglet.formats.io import read_jsonl
    from eaglet.model.target import load_tokenizer

    spec = j.target
    if spec.kind == "gguf" and not gguf_converted(spec):
        not_checked.append(
            f"the target's tokenizer and chat template: the built-in {spec.name} is "
            "de-quantized from its GGUF on first use, which loads the model; "
            f"`eaglet generate {j.dataset}` does it once (about 30 s)"
        )
        return None
    tokenizer = load_tokenizer(spec)
    out: dict = {"class": type(tokenizer).__name__}
    first = next(iter(read_jsonl(j.prompts)), None)
    if first is not None:
        ids = prompt_ids(tokenizer, first["messages"], first.get("tools"), j.mode_of(first))
        out["first_prompt"] = {"id": first["id"], "tokens": len(ids)}
    return out


def gguf_converted(spec) -> bool:
    """Whether the built-in GGUF target is de-quantized already: the folder
    eaglet.model.target.materialize keeps it in (cache/targets/<name>-<digest[:16]>)."""
    from eaglet.hashing import cache_dir, file_digest

    folder = cache_dir() / "targets" / f"{spec.name}-{file_digest(spec.location)[:16]}"
    return (folder / "config.json").is_file()


def show(report: dict) -> None:
    """Print a preflight report for people."""
    s, c = report["store"], report["check"]
    lines = [f"dry run: responses {report['dataset']} via {report['backend']} ({report['kind']})"]
    if c.get("in_process"):
        lines.append(f"  backend: in-process transformers, target {c['model']}")
    elif c.get("managed"):
        lines.append(
            f"  backend: a vLLM engine eaglet starts for the run (target {c['model']}); "
            f"vllm installed ({Path(c['vllm']).parent})"
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
    tok = report.get("tokenizer")
    if tok:
        first = tok.get("first_prompt")
        rendered = f"; chat template renders prompt {first['id']} ({first['tokens']} tokens)"
        lines.append(f"  tokenizer: {tok['class']}{rendered if first else ''}")
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
    lines += spend_lines(report["spend"])
    lines += [f"  not checked: {what}" for what in report["not_checked"]]
    print("\n".join(lines))
