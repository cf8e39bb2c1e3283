"""`eaglet status`: every artifact's current key and state, and how each generation stands.

An artifact is `up to date` when it exists at its current key, `stale` when only artifacts of
other keys exist (built from other params or code), else `missing`; `partial` when a build of
the current key was started and not finished (a hidden-states folder's shards, a drafter's
checkpoint), `damaged` when a hidden-states folder does not hold the shards its manifest names,
each with the command that continues or rebuilds it. A stale artifact says why: what the newest
other key's sidecar records (spec, code version, upstream keys) against the current inputs, in
`eaglet compare`'s words. Generation progress is read from the response store, so it is live
while `eaglet generate` runs in another process; an interrupted generation says so. An artifact
not built yet whose log exists (Snakemake's `logs/<stage>/<name>/<key>.log`: running, or
failed) names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time

from eaglet import locks
from eaglet.errors import AwaitedFile
from eaglet.formats.io import read_json
from eaglet.formats.metrics import summary_of
from eaglet.formats.store import Store, store_path
from eaglet.graph.artifacts import KEY_RE
from eaglet.graph.keys import COMMANDS, STAGES, Keys, lock_of, sidecar_of
from eaglet.params import Params
from eaglet.progress import BEACON
from eaglet.reports.compare import _changed, _flat
from eaglet.stages.responses import report
from eaglet.stages.responses.kernel import stop_note
from eaglet.stages.responses.run import scan, setup, spend_lines, spend_report

RUN_FRESH_S = 60.0  # a heartbeat older than this is not a run in progress
NO_PROVENANCE = "built from other inputs (no provenance to compare)"


def _state(path, stage) -> str:
    if path.exists():
        return "up to date"
    return "stale" if _others(path, stage) else "missing"


def _others(path, stage: str) -> list:
    """The artifacts of other keys beside `path` (`<key><ext>`), newest first."""
    ext = STAGES[stage].ext
    found = []
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            if ext == "/":
                key = p.name if p.is_dir() else ""
            else:
                key = p.name.removesuffix(ext) if p.name.endswith(ext) else ""
            with contextlib.suppress(OSError):
                if KEY_RE.match(key) and p != path:
                    found.append((p.stat().st_mtime, p))
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def _stale(keys: Keys, stage: str, name: str, path) -> dict:
    """Why `path` is stale: the newest artifact of another key, and what its sidecar records
    it was built from (spec, code version, upstream keys) against what the key is made of now."""
    older = _others(path, stage)[0]
    key = older.name.removesuffix(STAGES[stage].ext.strip("/"))
    try:
        old = read_json(sidecar_of(older)).get("provenance") or {}
    except (OSError, ValueError, AttributeError):
        old = {}
    if not isinstance(old.get("params"), dict):
        return {"from": key, "why": [NO_PROVENANCE]}
    now = keys.provenance(stage, name)
    why = _changed(old, now)
    before, after = _flat(old.get("upstream") or {}), _flat(now["upstream"])
    for up in dict.fromkeys([*after, *before]):
        if up not in before:
            why.append(f"upstream {up} added")
        elif up not in after:
            why.append(f"upstream {up} dropped")
        elif before[up] != after[up]:
            why.append(f"upstream {up} moved")
    return {"from": key, "why": why or ["no recorded input differs (another eaglet's key scheme)"]}


def _log(keys: Keys, stage: str, name: str) -> str | None:
    """The log the graph's rule writes for the current key (`logs/<stage>/<name>/<key>.log`,
    under Snakemake's working folder: the params file's, or this one), if there is one."""
    rel = os.path.join("logs", stage, name, f"{keys.key(stage, name)}.log")
    for base in dict.fromkeys([str(keys.params.root), os.getcwd()]):
        if os.path.isfile(os.path.join(base, rel)):
            return os.path.relpath(os.path.join(base, rel))
    return None


def generation(params: Params, dataset: str, keys: Keys, store: Store | None) -> dict | None:
    """Prompts, answers done and failed, tokens, cost, % of target and the run in progress."""

    if not keys.path("prompts", dataset).exists():
        return None
    j = setup(keys, keys.spec("responses", dataset))
    if store is None:
        s = {"prompts": j.count(), "ok": 0, "failed": 0, "rejected": 0, "tokens": 0, "cost": 0.0}
        s["turns"] = s["prompts"]  # at least one turn each: how many more, the store tells
    else:
        s = scan(j, store)
    if j.token_budget is not None:
        target = {"by": "token_budget", "of": j.token_budget, "have": s["tokens"]}
    else:
        target = {"by": "samples", "of": s["turns"], "have": s["ok"]}  # one per turn
    target["pct"] = (
        round(min(100.0, 100.0 * target["have"] / target["of"]), 1) if target["of"] else 100.0
    )
    run = store.run(dataset, j.response_key) if store is not None else None
    if run is not None and run["alive"] and time.time() - run["updated"] > RUN_FRESH_S:
        run["state"] = "stalled"
    return {
        "prompts": s["prompts"],
        "turns": s["turns"],
        "done": s["ok"],
        "failed": s["failed"],
        "rejected": s["rejected"],
        "tokens": s["tokens"],
        "cost": s["cost"],
        "target": target,
        "run": run,
    }


def _partial(path, stage: str) -> dict | None:
    """How far an unfinished build of `path` got: hidden shards journaled, training's step, and
    the running build's beacon (done, rate, tokens/s, ETA; training's loss)."""
    folder = path.parent / f".{path.name}.{'partial' if stage == 'hidden' else 'work'}"
    beat = None
    with contextlib.suppress(ValueError, OSError):
        beacon = folder / BEACON
        beat = {**json.loads(beacon.read_text()), "updated": beacon.stat().st_mtime}
    found = _journaled(path, stage, folder)
    if beat is None:
        return found
    return {**(found or {}), "progress": beat, "updated": beat["updated"]}


def _journaled(path, stage: str, folder) -> dict | None:
    if stage == "hidden":
        journal = folder / "journal.jsonl"
        if journal.is_file():
            lines = [x for x in journal.read_text(errors="replace").splitlines() if x.strip()]
            return {"shards": max(0, len(lines) - 1), "updated": journal.stat().st_mtime}
    if stage == "train":
        work = folder
        info = work / "checkpoint.json"
        if info.is_file():
            with contextlib.suppress(ValueError, OSError):
                return {**json.loads(info.read_text()), "updated": info.stat().st_mtime}
        if (work / "checkpoint.pt").is_file():
            return {"updated": (work / "checkpoint.pt").stat().st_mtime}
    return None


def _next(path, partial: dict, command: str) -> str:
    """Running, or stopped with the command that continues it. A build holds its artifact's
    lock (graph.keys.build) and removes it when it ends: a lock whose process is gone is a
    killed build, no lock a build that ended. Only a holder on another host (a shared folder)
    is judged by how fresh its files are."""
    who = locks.holder(lock_of(path))
    alive = who.alive() if who is not None else False
    if alive is None:
        alive = time.time() - partial["updated"] < RUN_FRESH_S
    if alive:
        return f"running (pid {who.pid})"
    gone = f" (pid {who.pid} is gone)" if who is not None else ""
    return f"interrupted{gone}; continue: {command}"


def kept(path, stage: str) -> str:
    """What an unfinished build of `path` left for a rerun to continue from, in words."""
    if stage == "responses":
        return "every answer received stays in the response store"
    partial = _partial(path, stage) or {}
    suffix = "partial" if stage == "hidden" else "work"
    folder = os.path.relpath(path.parent / f".{path.name}.{suffix}")
    if "shards" in partial:
        return f"{partial['shards']} shards kept in {folder}"
    if "step" in partial:
        return f"the checkpoint at step {partial['step']} kept in {folder}"
    return "nothing of it was published"


def _damage(path, stage: str) -> str | None:
    """A cheap look at a built hidden folder: every shard its manifest names, at its size
    (readers verify each shard's SHA-256 when they open it)."""
    if stage != "hidden" or not path.is_dir():
        return None
    try:
        manifest = read_json(path / "manifest.json")
    except (OSError, ValueError):
        return "manifest.json unreadable"
    for shard in manifest.get("shards", []):
        f = path / shard["name"]
        if not f.is_file():
            return f"{shard['name']} missing"
        if f.stat().st_size != shard["bytes"]:
            return f"{shard['name']}: {f.stat().st_size} bytes, the manifest says {shard['bytes']}"
    return None


def _row(params: Params, keys: Keys, store, kind: str, name: str, stage: str) -> dict:
    path = keys.path(stage, name)
    sidecar = keys.sidecar(stage, name)
    row = {
        "stage": stage,
        kind: name,
        "key": keys.key(stage, name),
        "path": os.path.relpath(path),
        "state": _state(path, stage),
    }
    command = COMMANDS[stage].format(name)
    if row["state"] != "up to date" and (partial := _partial(path, stage)):
        row["state"], row["partial"] = "partial", partial
        row["next"] = _next(path, partial, command)
    elif row["state"] == "up to date" and (damage := _damage(path, stage)):
        row["state"], row["damage"] = "damaged", damage
        row["next"] = f"rebuild: rm -r {row['path']} && {command}"
    elif row["state"] == "stale":
        row["stale"] = _stale(keys, stage, name, path)
    if path.exists() and sidecar.exists():
        row["stats"] = read_json(sidecar).get("stats", {})
    if stage == "responses":
        row["generation"] = generation(params, name, keys, store)
        if not path.exists() and (note := _stopped(path)):
            row["stopped"] = note
    if stage == "hidden" and path.is_dir():
        row["disk_bytes"] = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    if row["state"] != "up to date" and (log := _log(keys, stage, name)):
        row["log"] = log
    return row


def _stopped(path) -> str | None:
    """Why the responses stage stopped on its checks at this key (drift, round trip), if so."""
    try:
        return read_json(stop_note(path)).get("reason")
    except (OSError, ValueError, AttributeError):
        return None


def _waiting(kind: str, name: str, stage: str, e: AwaitedFile) -> dict:
    """The row of an artifact whose key waits for a file only its stage reads."""
    return {
        "stage": stage,
        kind: name,
        "key": "-" * 12,
        "path": "-",
        "state": "waiting",
        "waiting_for": {"file": e.file, "field": e.field},
    }


def collect(params: Params) -> list[dict]:
    """One row per (stage, dataset): key, path, state, the stats of its sidecar, progress."""
    keys = Keys(params)
    path = store_path(params.root)
    store = Store(path) if path.exists() else None
    rows = []
    try:
        for kind, names in (("dataset", params.datasets), ("drafter", params.drafters)):
            for name in names:
                for stage in (s.name for s in STAGES.values() if s.kind == kind):
                    try:
                        rows.append(_row(params, keys, store, kind, name, stage))
                    except AwaitedFile as e:  # no key until the file is there
                        rows.append(_waiting(kind, name, stage, e))
        if store is not None:  # the project's, beside each dataset's own
            spend = spend_report(params.path.name, params.data["budget"]["count"], store)
            for r in rows:
                if r.get("generation"):
                    r["generation"]["spend"] = spend
    finally:
        if store is not None:
            store.close()
    return rows


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _summary(row: dict) -> str:
    """The row's state in words: why it is stale, its stats or progress, its log."""
    parts = [_details(row)]
    if stale := row.get("stale"):
        old, why = stale["from"], stale["why"]
        known = f"since {old}: " + "; ".join(map(_short, why))
        parts.insert(0, f"{old} was {NO_PROVENANCE}" if why == [NO_PROVENANCE] else known)
    if row.get("stopped"):
        parts.append(f"stopped: {row['stopped']}")
    if row.get("log"):
        parts.append(f"log: {row['log']}")
    return "; ".join(p for p in parts if p)


def _short(change: str) -> str:
    """A change as the status line shows it: SHA-256 digests cut to 12 hex, as keys are."""
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{52}\b", r"\1", change)


def _details(row: dict) -> str:
    """The row's state in words: an unfinished, damaged or waiting build, else its stats."""
    if row["state"] == "partial":
        return f"{_unfinished(row['partial']) or 'started'}; {row['next']}"
    if row["state"] == "damaged":
        return f"{row['damage']}; {row['next']}"
    if row["state"] == "waiting":
        w = row["waiting_for"]
        return f"waits for {w['file']} ({w['field']}): add the file, then build"
    st = row.get("stats", {})
    if row["stage"] == "responses":
        return _generated(row["generation"], row["dataset"], st) if row.get("generation") else ""
    built = BUILT.get(row["stage"])
    return built(row, st) if built and st else ""


def _unfinished(p: dict) -> str:
    """How far an unfinished build got: shards or checkpoint kept, and its running beacon."""
    done = f"{p['shards']} shards built" if "shards" in p else ""
    if "step" in p:
        done = f"checkpoint at step {p['step']}" + (f"/{p['total']}" if "total" in p else "")
        done += f" ({_seen(p['datasets'])})" if p.get("datasets") else ""
    if b := p.get("progress"):
        done = (
            f"{b['done']}/{b['total']} {b['unit']}, {b['tok_s']:,.0f} tok/s, ETA "
            + (_duration(b["eta_s"]) + (f", loss {b['loss']:.3f}" if b.get("loss") else ""))
            + (f"; {done}" if done else "")
        )
    return done


def _generated(g: dict, dataset: str, st: dict) -> str:
    """A dataset's answers: how many, their tokens against the target, failures, cost, the
    regeneration checks and the run in progress or interrupted."""
    t = g["target"]
    if g["turns"] == g["prompts"]:
        text = f"{g['done']}/{g['prompts']} answered"
    else:  # several turns a conversation
        text = f"{g['done']}/{g['turns']} turns of {g['prompts']} conversations answered"
    text += f", {g['tokens']:,} tok ({t['pct']:.0f}% of "
    if t["by"] == "token_budget":
        text += "token budget)"
    else:
        text += "prompts)" if g["turns"] == g["prompts"] else "turns)"
    if g["failed"]:
        text += f", {g['failed']} failed"
    if g.get("rejected"):
        text += f", {g['rejected']} rejected for good"
    if g["cost"]:
        text += f", ${g['cost']:.4f}"
    text += _answer_checks(st)
    run = g["run"]
    if run and run["state"] == "interrupted" and g["done"] < g["turns"]:
        text += f"; interrupted at {run.get('done', '?')}/{run.get('total', '?')}"
        text += f" (continue: eaglet generate {dataset})"
    if run and run["state"] in ("running", "stalled"):
        text += (
            f"; {run['state']}: {run['done']}/{run['total']}, {run['rate']:.2f} req/s, "
            f"ETA {_duration(run['eta_s'])}"
        )
    return text


def _answer_checks(st: dict) -> str:
    """What the responses stage's sidecar says of the answers: token drift, answers written in
    the target's grammar or left out, and the regeneration checks."""
    text = ""
    drift = st.get("token_drift")
    if drift and drift["records"]:
        text += f", token drift {drift['drift']:.2%}"
        text += f" (worst {drift['worst']['id']})" if drift["worst"] else ""
    if st.get("from_grammar"):
        text += f", {st['from_grammar']} written in the target's grammar"
    if (u := st.get("unwritable")) and u["count"]:
        first = u["first"][0]
        text += f", {u['count']} left out (first {first['id']}: {first['reason']})"
    checks = report.summary(st.get("regeneration", {}))
    return text + (f"; {checks}" if checks else "")


def _prompted(row: dict, st: dict) -> str:
    return f"{st['kept']} prompts ({st['bad_rows']} bad rows, {st['duplicates']} duplicates)"


def _stored(row: dict, st: dict) -> str:
    """Hidden states: sequences, tokens and bytes a token on disk against the states' own."""
    per_token = row["disk_bytes"] / st["tokens"]
    seqs = f"{st['samples']} seqs"
    if st.get("merged_turns"):  # turns of a conversation sharing a sample
        seqs += f" ({st['samples'] + st['merged_turns']} turns)"
    if "state_bytes_per_token" not in st:  # online/hybrid: no shards in the stage's folder
        return f"{seqs}, {st['tokens']} tok, ids only: states from the engine"
    return (
        f"{seqs}, {st['tokens']} tok, {per_token:.0f} B/tok on disk "
        f"= {st['state_bytes_per_token']} x {per_token / st['state_bytes_per_token']:.3f}"
    )


def _picked(row: dict, st: dict) -> str:
    return f"{st['draft_vocab_size']} ids, {100 * st['coverage']:.1f}% of assistant tokens"


def _trained(row: dict, st: dict) -> str:
    """Training: steps, final loss, held-out accuracy, warm start, data seen, the epoch kept."""
    acc = (st.get("heldout") or {}).get("acc") or [float("nan")]
    shares = ", ".join(
        f"{name} {s['share']:.2f}"
        for name, s in (st.get("supervised_share") or {}).items()
        if s["share"] is not None
    )
    text = f"{st['steps']} steps, loss {st['final_loss']:.3f}, held-out acc@0 {acc[0]:.2f}"
    if w := st.get("init_from"):
        text += (
            f", warm start ({w['format']} format, {w['rows_copied']}/{w['draft_vocab']} "
            "lm_head rows)"
        )
    if seen := st.get("datasets"):
        text += f", trained on {_seen(seen)}"
    if sel := st.get("selected"):
        text += (
            f", kept epoch {sel['epoch'] + 1} of {len(sel['curve'])} (offline acceptance "
            f"{sel['value']:.3f}, last {sel['curve'][-1]:.3f})"
        )
    return text + (f", supervised {shares}" if shares else "")


def _seen(datasets: dict) -> str:
    """What each dataset trained: samples, tokens and the steps it had a sample in (and its
    weight, where the drafter's datasets are weighted)."""
    parts = []
    for name, s in datasets.items():
        weight = f" (weight {s['weight']:g})" if "weight" in s else ""
        parts.append(
            f"{name}{weight} {s['samples']:,} samples/{s['tokens']:,} tok/{s['steps']:,} steps"
        )
    return ", ".join(parts)


def _values(by_steps: dict) -> str:
    return "/".join(f"{v:.2f}" if v is not None else "?" for v in by_steps.values())


def _evaluated(row: dict, st: dict) -> str:
    """Acceptance length per suite and temperature: the engine's, and eaglet's own."""
    summary = summary_of(st, str(sidecar_of(row["path"])))
    engine = any(s.vllm for s in summary.suites.values())
    parts = []
    for name, s in summary.suites.items():
        runs = s.vllm if engine else s.eaglet
        shown = ", ".join(f"t={t:g} {_values(by_steps)}" for t, by_steps in runs.items())
        if engine and 0 in s.eaglet:
            shown += f" (eaglet t=0 {_values(s.eaglet[0])})"
        if not all(s.greedy_equal.values()):
            shown += " NOT greedy-equal"
        parts.append(f"{name} {shown}")
    return f"{'vLLM ' if engine else ''}acceptance length: " + "; ".join(parts)


# The stats of a built artifact in words, per stage (responses: _generated, from the store).
BUILT = {
    "prompts": _prompted,
    "hidden": _stored,
    "vocab": _picked,
    "train": _trained,
    "evaluate": _evaluated,
}


def show(params: Params, as_json: bool = False) -> None:
    rows = collect(params)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    width = max(len(r.get("dataset") or r["drafter"]) for r in rows)
    spend = next(
        (r["generation"]["spend"] for r in rows if "spend" in (r.get("generation") or {})), None
    )
    for r in rows:
        name = r.get("dataset") or r["drafter"]
        print(
            f"{name:<{width}}  {r['stage']:<9}  {r['key']}  {r['state']:<10}  "
            f"{_summary(r):<58}  {r['path']}"
        )
    for line in spend_lines(spend) if spend else []:
        print(line.removeprefix("  "))
