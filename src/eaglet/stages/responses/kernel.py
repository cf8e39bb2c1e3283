"""What decides the responses' bytes: which answers the output holds (the prefix of the prompt
order, whole conversations), in what order, and how they are written."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eaglet.errors import EagletError
from eaglet.formats.grammar import answer_calls, grammar
from eaglet.formats.io import write_json, write_jsonl_zst
from eaglet.formats.records import response_record
from eaglet.formats.store import Store
from eaglet.formats.stream import Drift, Unwritable, Writer
from eaglet.graph.keys import sidecar_of
from eaglet.model.target import load_tokenizer
from eaglet.stages.responses import report
from eaglet.stages.responses.turns import Turn

if TYPE_CHECKING:
    from eaglet.stages.responses.job import Job


# ---------------------------------------------------------------------------- output


def rejected(row: dict | None, limit: int) -> bool:
    """Excluded for good: rejected by the API, or a prompt still too long for `limit` (a larger
    max_length sends it after all)."""
    if row is None or row["status"] != "rejected":
        return False
    info = row["rejected"]
    return info["kind"] != "too_long" or (info["prompt_tokens"] or 0) >= limit


def dropped(job: Job, row: dict) -> bool:
    """An answer cut at max_new_tokens, left out of the samples (`truncated: drop`): trained on,
    it would teach the drafter an ending the target never wrote."""
    return job.truncated == "drop" and row["result"]["finish_reason"] == "length"


def plan_output(job: Job, store: Store) -> dict:
    """Which prefix of the prompt order the output holds, and its stats, from the store alone:
    whole conversations, each with the turns it keeps.

    Raises EagletError when a turn of the prefix has no answer (failed or not generated)."""
    st = {"responses": 0, "conversations": 0, "completion_tokens": 0, "prompt_tokens": 0}
    st["cost"] = None
    excluded: Counter = Counter()
    first_rejection: dict[str, str] = {}
    finish: Counter = Counter()
    cost, spent = 0.0, 0  # what the prefix cost, dropped answers included
    truncated = {"dropped": 0, "kept": 0, "first": []}
    stopped_by = None
    failed, missing, first_error = 0, 0, None
    for chunk in job.conversations(store):
        for conv in chunk:
            ok, lacking, error = _sort_turns(job, conv, excluded, first_rejection)
            first_error = first_error or error
            # a conversation's known answers past a budget end the prefix before it, turns
            # not asked yet included (dispatch stops there too)
            t = sum(row["completion_tokens"] for _, row in ok)
            c = sum(row["cost"] or 0.0 for _, row in ok)
            stopped_by = _past_budget(job, spent + t, cost + c)
            if stopped_by:
                break
            failed, missing = failed + lacking["failed"], missing + lacking["missing"]
            if failed or missing:
                continue  # the prefix is already broken: only count what is lacking
            spent += t
            if any(row["cost"] is not None for _, row in ok):
                cost += c
                st["cost"] = cost
            _count_kept(job, ok, st, finish, truncated)
        if stopped_by:
            break
    _check_answered(job, failed, missing, first_error)
    out = {**st, "finish_reasons": dict(finish), "stopped_by": stopped_by, "truncated": truncated}
    out["rejected"] = {"api": excluded["api"], "too_long": excluded["too_long"]}
    out["first_rejected"] = first_rejection
    return out


def _sort_turns(
    job: Job, conv: list[tuple[Turn, dict | None]], excluded: Counter, first_rejection: dict
) -> tuple[list[tuple[Turn, dict]], Counter, str | None]:
    """A conversation's answered turns, how many lack an answer (failed, missing) and the first
    failure; its excluded turns are counted into `excluded`, the first of each kind kept in
    `first_rejection`."""
    ok: list[tuple[Turn, dict]] = []
    lacking: Counter = Counter()
    first_error = None
    for turn, row in conv:
        if rejected(row, job.prompt_limit):
            kind = row["rejected"]["kind"]
            excluded[kind] += 1
            first_rejection.setdefault(kind, f"{turn.id}: {row['error']}")
        elif row is None or row["status"] == "rejected":
            lacking["missing"] += 1
        elif row["status"] != "ok":
            lacking["failed"] += 1
            first_error = first_error or f"{turn.id}: {row['error']}"
        else:
            ok.append((turn, row))
    return ok, lacking, first_error


def _past_budget(job: Job, tokens: int, cost: float) -> str | None:
    """The dataset's budget a prefix of `tokens` and `cost` passes, if any."""
    if job.token_budget is not None and tokens > job.token_budget:
        return "token_budget"
    if job.max_cost_usd is not None and cost > job.max_cost_usd:
        return "max_cost_usd"
    return None


def _count_kept(
    job: Job, ok: list[tuple[Turn, dict]], st: dict, finish: Counter, truncated: dict
) -> None:
    """Count a conversation of the prefix into the stats: the answers it keeps, and those cut
    at max_new_tokens (kept or dropped, `truncated`)."""
    kept = 0
    for turn, row in ok:
        if row["result"]["finish_reason"] == "length":
            truncated["kept" if job.truncated == "keep" else "dropped"] += 1
            if len(truncated["first"]) < 5:
                truncated["first"].append(turn.id)
        if dropped(job, row):
            continue
        kept += 1
        st["completion_tokens"] += row["completion_tokens"]
        st["prompt_tokens"] += row["result"]["prompt_tokens"] or 0
        finish[row["result"]["finish_reason"]] += 1
    st["responses"] += kept
    st["conversations"] += kept > 0


def _check_answered(job: Job, failed: int, missing: int, first_error: str | None) -> None:
    """Raise when turns of the prefix have no answer: `failed` and `missing` of them."""
    if not (failed or missing):
        return
    what = []
    if failed:
        what.append(f"{failed} failed (first: {first_error})")
    if missing:
        what.append(f"{missing} not generated")
    raise EagletError(
        f"responses {job.dataset}: prompts without an answer: {'; '.join(what)}; "
        "rerun `eaglet generate` to retry them"
    )


def output_records(job: Job, store: Store, n: int) -> Iterator[dict]:
    """The first `n` response records (one per kept turn) in prompt and turn order, read from
    the store as stored."""
    left = n
    for chunk in job.conversations(store):
        for conv in chunk:
            for turn, row in conv:
                if not left:
                    return
                if rejected(row, job.prompt_limit) or dropped(job, row):
                    continue
                result = dict(row["result"], attempts=row["attempts"])
                result.setdefault("server_completion_tokens", result["completion_tokens"])
                prompt = {**turn.prompt, "id": turn.id, "messages": turn.messages}
                rec = response_record(prompt, result, job.backend, job.sampling)
                if job.mode is not None:  # the template arguments its prompt is rendered with
                    rec["chat_template_kwargs"] = job.mode_of(turn.prompt)
                yield rec
                left -= 1


class Streams:
    """Response records -> the target's generated tokens (`output_ids`: the engine's, or a text
    answer written in the target's grammar and read back), the stored count their length, and
    the drift of that count from the server's over the dataset. A text answer that cannot be
    written as the model's stream is left out, counted with its reason."""

    def __init__(self, job: Job):
        self.job, self.grammar = job, grammar(job.grammar)
        self.writer: Writer | None = None
        self.drift = Drift()
        self.unwritable: list[dict] = []

    def add(self, rec: dict) -> dict | None:
        """The record with its tokens, or None when it cannot be written (counted)."""
        if rec["output_ids"] is None:
            if self.writer is None:
                tok = load_tokenizer(self.job.target)
                self.writer = Writer(tok, self.grammar, keep_marker_text=self.keep)
            if rec.get("tool_calls"):
                rec["tool_calls"] = answer_calls(rec["tool_calls"], rec["messages"], self.grammar)
            try:
                rec["output_ids"] = self.writer.output_ids(rec)
            except Unwritable as e:
                self.unwritable.append({"id": rec["id"], "reason": str(e)})
                return None
        rec["completion_tokens"] = len(rec["output_ids"])
        self.drift.add(rec["id"], rec["completion_tokens"], rec["server_completion_tokens"])
        return rec

    @property
    def keep(self) -> bool:
        return self.job.marker_text == "keep"

    def stats(self) -> dict:
        w = self.writer
        written = w.written - len(self.unwritable) if w else 0
        out = {"token_drift": self.drift.summary(), "from_grammar": written}
        if w is not None and w.parsers is not None:
            out["round_trip"] = f"{w.parsers.source}'s {self.grammar.name} parsers"
        out["unwritable"] = {"count": len(self.unwritable), "first": self.unwritable[:5]}
        return out

    def check(self) -> None:
        self.drift.check(self.job.dataset, self.job.max_token_drift)


def stop_note(out: Path) -> Path:
    """Where a responses stage that stopped on its checks (drift, round trip) says why, beside
    the output it did not write; `eaglet status` shows it."""
    return out.with_name(out.name.split(".")[0] + ".stopped.json")


def write_output(job: Job, store: Store, out: Path, prov: dict, extra: dict) -> dict:
    """Write the sidecar, then the records (atomically each); return the stats. Stopped by a
    check, leave the reason beside (`stop_note`)."""
    stats = {"prompts": job.count(), **plan_output(job, store), **extra}
    stats["turns"] = job.turns
    st = Streams(job)
    try:
        written = (st.add(r) for r in output_records(job, store, stats["responses"]))
        records = [r for r in written if r is not None]
        st.check()
    except EagletError as e:
        write_json(stop_note(out), {"reason": str(e)})
        raise
    stop_note(out).unlink(missing_ok=True)
    stats |= st.stats()
    stats["responses"] = len(records)
    if job.mode is not None:  # how many answers each mode has
        on = sum(next(iter(r["chat_template_kwargs"].values())) for r in records)
        stats["modes"] = {"thinking": on, "instant": len(records) - on}
    stats["regeneration"] = report.report(records, stats, st.grammar)
    stats["completion_tokens"] = sum(r["completion_tokens"] for r in records)
    write_json(sidecar_of(out), {"provenance": prov, "stats": stats})
    write_jsonl_zst(out, records)
    return stats
