"""The responses stage's run: the job resolved (setup), how the store stands (scan), the misses
dispatched to the engine (eaglet.stages.responses.dispatch), the spend accounted, the output
written."""

from __future__ import annotations

import time
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.io import dumps
from eaglet.formats.store import Locked, Origin, RequestKeys, Store, charged, store_path
from eaglet.graph.keys import Keys, Spec
from eaglet.stages.responses.dispatch import dispatch
from eaglet.stages.responses.job import Job
from eaglet.stages.responses.kernel import rejected, write_output
from eaglet.stages.responses.spec import ResponsesSpec


def setup(
    keys: Keys, spec: Spec[ResponsesSpec], threads: int | None = None, quiet: bool = False
) -> Job:
    """The dataset's generation beside its spec: the backend's settings, the store, the
    prompts (built first), the budgets."""
    params, dataset, v = keys.params, spec.name, spec.values
    backend = params.generation(dataset)["backend"]
    kind = v.backend["kind"]
    prompts = keys.path("prompts", dataset)
    if not prompts.exists():
        raise EagletError(
            f"{prompts}: prompts of '{dataset}' are not built (run: eaglet prompts {dataset})"
        )
    if v.max_cost_usd and kind != "openai":
        raise EagletError(
            f"{params.path}: datasets.{dataset}.max_cost_usd: backend '{backend}' ({kind}) "
            "reports no cost"
        )
    return Job(
        dataset=dataset,
        backend=backend,
        kind=kind,
        engine=params.backend(backend),
        target=keys.target,
        max_length=params.target["max_length"],
        prompt_limit=v.max_length,
        sampling=v.sampling,
        keyfn=RequestKeys({"backend": v.backend, "target": v.target}, v.sampling),
        prompts=prompts,
        store=store_path(params.root),
        out=keys.path("responses", dataset),
        token_budget=v.token_budget,
        max_cost_usd=v.max_cost_usd,
        overall=params.data["budget"],
        response_key=spec.key,
        grammar=v.grammar,
        max_token_drift=params.generation(dataset)["max_token_drift"],
        mode=v.mode,
        truncated=v.truncated,
        marker_text=v.marker_text,
        turns=v.turns,
        threads=threads,
        quiet=quiet,
        params_name=params.path.name,
    )


def scan(job: Job, store: Store) -> dict:
    """How the store stands for the dataset: its prompts (conversations), the turns a whole
    run asks, and those answered, failed, refused and missing (a replayed turn not askable yet
    counts as missing, with its recorded history's size)."""
    out = {"prompts": 0, "turns": 0, "ok": 0, "failed": 0, "missing": 0, "tokens": 0}
    out |= {"cost": 0.0, "missing_prompt_chars": 0, "rejected": 0}
    for chunk in job.conversations(store):
        for conv in chunk:
            out["prompts"] += 1
            last = conv[-1][0]
            out["turns"] += len(conv)
            for turn, row in conv:
                if rejected(row, job.prompt_limit):
                    out["rejected"] += 1
                elif row is not None and row["status"] == "ok":
                    out["ok"] += 1
                    out["tokens"] += row["completion_tokens"]
                    out["cost"] += row["cost"] or 0.0
                else:
                    out["failed" if row is not None and row["attempts"] else "missing"] += 1
                    out["missing_prompt_chars"] += len(dumps(turn.messages))
            row = conv[-1][1]
            if row is not None and (row["status"] == "ok" or rejected(row, job.prompt_limit)):
                continue  # complete, or ended: its later turns are never asked
            for _ in range(last.k, last.n):
                out["turns"] += 1
                out["missing"] += 1
                out["missing_prompt_chars"] += len(dumps(last.prompt["messages"]))
    return out


def run(spec: Spec[ResponsesSpec], j: Job, out: Path) -> Path:
    """Generate what the store lacks for `j`; write the responses `spec` describes at `out`.
    One generation of a dataset at a time: a second one is refused, naming the first."""
    store = Store(j.store, Origin("generated", j.params_name, j.dataset))
    try:
        with store.lock(j.dataset):
            return _run(spec, j, out, store, j.threads, j.quiet)
    except Locked as e:
        raise EagletError(f"responses {e}; wait for it or stop it") from None
    finally:
        store.close()


def _run(spec: Spec, j: Job, out: Path, store: Store, threads: int | None, quiet: bool) -> Path:
    before = scan(j, store)
    misses = before["failed"] + before["missing"]
    t0 = time.monotonic()
    sent = 0
    stopped_by = None
    if misses:
        sent, stopped_by = dispatch(j, store, misses, threads, quiet)
    extra = {
        "store_hits": before["ok"],
        "requests_sent": sent,
        "elapsed_s": round(time.monotonic() - t0, 3),
        "spend": spend_report(j.params_name, j.spend_count, store),
    }
    try:
        write_output(j, store, out, spec.provenance(), extra)
    except EagletError as e:
        if stopped_by and stopped_by.startswith("budget."):
            s = extra["spend"]
            raise EagletError(
                f"{e} (overall {stopped_by} reached: {s['charged']['tokens']:,} tokens, "
                f"${s['charged']['cost']:.4f} charged under budget.count: {s['count']}; "
                f"{_beside(s)})"
            ) from None
        raise
    return out


def spend_report(params_name: str | None, count: str, store: Store) -> dict:
    """The project's spend as the budget counts it: what is charged (`budget.count`), and the
    store's answers by origin ({"answers", "tokens", "cost"} each): this params file's
    (`this_run`), other params files' (`other_runs`), imported, of unknown origin."""
    parts = store.spend(params_name)
    tokens, cost = charged(parts, count)
    return {
        "count": count,
        "params": params_name,
        "charged": {"tokens": tokens, "cost": cost},
        **parts,
    }


def _beside(s: dict) -> str:
    """The answers a spend report does not charge, in words."""
    if s["count"] == "store":
        return "every answer in the store charged"
    out = []
    for part, what in (("imported", "imported"), ("other_runs", "of other params files")):
        p = s[part]
        if p["answers"]:
            out.append(f"{p['answers']:,} {what} (${p['cost']:.4f}, {p['tokens']:,} tokens)")
    return "not charged: " + (", ".join(out) if out else "none")


def spend_lines(s: dict) -> list[str]:
    """The project's spend as the budget charges it, and the answers beside it."""
    if not any(s[p]["answers"] for p in ("this_run", "other_runs", "imported", "unknown")):
        return []

    def part(p: dict, what: str) -> str:
        return f"{p['answers']:,} {what} (${p['cost']:.4f}, {p['tokens']:,} tokens)"

    c = s["charged"]
    head = f"  spend (budget.count: {s['count']}): charged ${c['cost']:.4f}, {c['tokens']:,} tokens"
    mine = [part(s["this_run"], f"answers generated under {s['params']}")]
    if s["unknown"]["answers"]:
        mine.append(part(s["unknown"], "stored before the store recorded origins"))
    beside = []
    if s["imported"]["answers"]:
        beside.append(part(s["imported"], "imported"))
    others = s["other_runs"]
    if others["answers"]:
        names = ", ".join(f"{n} {p['answers']:,}" for n, p in sorted(others["by_params"].items()))
        beside.append(part(others, f"of other params files: {names}"))
    if s["count"] == "store":
        return [f"{head}: every answer in the store: {'; '.join(mine + beside)}"]
    lines = [f"{head}: {'; '.join(mine)}"]
    if beside:
        lines.append(f"  beside, not charged: {'; '.join(beside)}")
    return lines
