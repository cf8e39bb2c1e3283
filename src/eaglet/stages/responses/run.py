"""The responses stage's run: the job resolved, the engine set up, the prompts dispatched
to it (Dispatch), the spend accounted, the output written."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import time
from pathlib import Path

from eaglet.engines.http import Abort
from eaglet.engines.lookup import Backend
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.io import dumps
from eaglet.formats.store import Locked, Origin, RequestKeys, Store, charged, store_path
from eaglet.graph.keys import Keys, Spec
from eaglet.model.target import load_tokenizer
from eaglet.progress import Progress
from eaglet.stages.responses.job import Job
from eaglet.stages.responses.kernel import rejected, write_output
from eaglet.stages.responses.spec import ResponsesSpec
from eaglet.stages.responses.turns import Turn

HEARTBEAT_S = 2.0


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


# ---------------------------------------------------------------------------- dispatch


class Dispatch:
    """Sends the misses of one dataset in prompt order, within its budgets."""

    def __init__(self, job: Job, backend: Backend, store: Store, progress: Progress):
        self.job, self.backend, self.store, self.progress = job, backend, store, progress
        self.tokens, self.cost = 0, 0.0  # the prefix so far: actual answers + in-flight estimates
        self.inflight: dict[str, tuple[int, float]] = {}  # key -> its estimate
        self.flying = [0, 0.0]  # the sum of those estimates
        self.known = [0, 0, 0.0]  # answers seen, their tokens, their cost: the estimates' base
        self.spent = job.spend(store)  # charged to the project budget (budget.count)
        self.new_spend = [0, 0.0]  # this run's answers since `spent` was read
        self.changed = asyncio.Event()
        self.pending: list[tuple[dict, dict | None]] = []  # outcomes not yet committed
        self._flush: asyncio.Handle | None = None
        self.abort: BaseException | None = None
        self.stopped_by: str | None = None
        self.sent = 0
        self.asked: set[str] = set()  # keys sent by this run: a failed one waits for a rerun
        self.lost = 0  # answers that arrived (paid) and could not be stored
        self.dropped = 0  # requests in flight when the run was interrupted
        self._tokenizer = None

    def estimate(self) -> tuple[int, float]:
        n, tokens, cost = self.known
        if n:
            return round(tokens / n), cost / n
        return self.job.sampling["max_new_tokens"], 0.0

    def over(self, sending: bool) -> str | None:
        """The budget the prefix so far (in-flight answers at their estimate) has passed; the
        project's overall budget counts only before `sending` a request."""
        j = self.job
        if j.token_budget is not None and self.tokens > j.token_budget:
            return "token_budget"
        if j.max_cost_usd is not None and self.cost > j.max_cost_usd:
            return "max_cost_usd"
        caps = j.caps
        if not sending or not caps:
            return None
        tokens = self.spent[0] + self.new_spend[0] + self.flying[0]
        cost = self.spent[1] + self.new_spend[1] + self.flying[1]
        if "token_budget" in caps and tokens >= caps["token_budget"]:
            return "budget.token_budget"
        if "max_cost_usd" in caps and cost >= caps["max_cost_usd"]:
            return "budget.max_cost_usd"
        return None

    def refresh_spend(self) -> None:
        """Re-read the project's spend (other processes of this run add to it too)."""
        self.spent, self.new_spend = self.job.spend(self.store), [0, 0.0]

    def _known(self, tokens: int, cost: float | None) -> None:
        self.known[0] += 1
        self.known[1] += tokens
        self.known[2] += cost or 0.0

    async def run(self) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.backend.concurrency)
        workers = [asyncio.create_task(self.worker(queue)) for _ in range(self.backend.concurrency)]
        try:
            # a walk that sent a turn some later turn waits on is followed by another, once
            # every answer it sent is in; the last walk's budget stop is the run's (a later
            # walk knows more of each conversation, so its prefix is shorter or the same)
            while True:
                more = await self.produce(queue)
                while self.inflight and self.abort is None:
                    self.changed.clear()
                    await self.changed.wait()
                if not more or self.abort is not None:
                    break
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
        except BaseException:  # Ctrl-C (cancelled) or a failure: stop sending at once
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            if self._flush is not None:
                self._flush.cancel()
            self.commit()  # what arrived is kept
        if self.abort is not None:
            raise self.abort

    async def produce(self, queue: asyncio.Queue) -> bool:
        """One walk over the conversations in prompt order: send the turns the store lacks
        and this run has not asked yet, within the budgets. True if a later turn waits on an
        answer it sent."""
        window: list[dict] = []
        more = False
        self.tokens, self.cost, self.known = 0, 0.0, [0, 0, 0.0]  # the prefix, from the start
        self.stopped_by = None

        async def flush() -> None:
            for batch in self.backend.plan(window) if window else []:
                await queue.put(batch)
            window.clear()

        for chunk in self.job.conversations(self.store):
            for conv in chunk:
                for turn, row in conv:
                    key = turn.key
                    if rejected(row, self.job.prompt_limit):
                        continue  # excluded for good: not sent, not in the output
                    hit = row is not None and row["status"] == "ok"
                    if not hit and (key in self.asked or self.too_long(turn)):
                        continue
                    while (reason := self.over(sending=not hit)) and self.abort is None:
                        if window:
                            await flush()
                        elif not self.inflight:
                            self.stopped_by = reason  # exact now: the prefix ends here
                            return more
                        else:
                            self.changed.clear()
                            await self.changed.wait()
                    if self.abort is not None:
                        return more
                    if hit:
                        self.tokens += row["completion_tokens"]
                        self.cost += row["cost"] or 0.0
                        self._known(row["completion_tokens"], row["cost"])
                        continue
                    est = self.estimate()
                    self.asked.add(key)
                    self.inflight[key] = est
                    self.tokens, self.cost = self.tokens + est[0], self.cost + est[1]
                    self.flying = [self.flying[0] + est[0], self.flying[1] + est[1]]
                    more |= turn.k < turn.n and turn.replay
                    window.append(
                        {
                            "id": turn.id,
                            "key": key,
                            "messages": turn.messages,
                            "tools": turn.prompt.get("tools"),
                            "sampling": self.job.sampling,
                            "mode": self.job.mode_of(turn.prompt),
                        }
                    )
                    if len(window) >= self.backend.window:
                        await flush()
        await flush()
        return more

    def too_long(self, turn: Turn) -> bool:
        """A request that leaves no room for an answer in the dataset's max_length is never
        sent: recorded as rejected (too_long) with its length, and counted."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.job.target)
        mode = self.job.mode_of(turn.prompt)
        n = len(prompt_ids(self._tokenizer, turn.messages, turn.prompt.get("tools"), mode))
        limit = self.job.prompt_limit
        if n < limit:
            return False
        reason = f"prompt of {n} tokens does not fit max_length {limit}"
        self.store.reject(turn.key, "too_long", reason, n)
        return True

    async def worker(self, queue: asyncio.Queue) -> None:
        while (batch := await queue.get()) is not None:
            if self.abort is not None:
                results = [None] * len(batch)
            else:
                try:
                    results = await self.backend.generate(batch)
                except Abort as e:
                    self.abort = e
                    results = [None] * len(batch)
                except asyncio.CancelledError:
                    self.dropped += len(batch)  # interrupted in flight: no answer came
                    raise
                except Exception as e:  # a backend's bug: a failed request, never a dead worker
                    error = f"{type(e).__name__}: {e}"
                    results = [{"error": error, "attempts": 1} for _ in batch]
            self.pending.extend(zip(batch, results, strict=True))
            if self._flush is None:
                self._flush = asyncio.get_running_loop().call_soon(self.commit)

    def commit(self) -> None:
        """Commit every outcome that arrived in this turn of the event loop in one transaction;
        only then do they count as done. A store that cannot write stops the run: what was
        committed stays, what could not be is reported as lost."""
        pending, self.pending, self._flush = self.pending, [], None
        arrived = [(req, res) for req, res in pending if res is not None]
        try:
            with self.store.transaction():
                for req, res in arrived:
                    self.store.put(req["key"], self.job.keyfn.backend, res)
                    if res.get("rejected"):
                        self.store.reject(req["key"], "api", res["error"])
        except (sqlite3.Error, OSError) as e:
            self.lost += sum("error" not in res for _, res in arrived)
            self.abort = self.abort or EagletError(
                f"{self.store.path}: cannot store answers ({type(e).__name__}: {e}); the run "
                "stopped, every answer committed before is kept"
            )
            pending = [(req, None) for req, _ in pending]
        for req, res in pending:
            self.settle(req["key"], res)
        self.changed.set()

    def settle(self, key: str, result: dict | None) -> None:
        """Count a committed outcome: the prefix now holds its actual size."""
        est_tokens, est_cost = self.inflight.pop(key)
        self.flying = [self.flying[0] - est_tokens, self.flying[1] - est_cost]
        if result is None:  # never sent: the run aborted
            return
        self.sent += 1
        if "error" not in result and result.get("cost") is None and self._priced():
            self.abort = EagletError(
                f"backend '{self.job.backend}' returned no cost but a dollar budget applies "
                "(set price_per_mtok)"
            )
        if "error" in result:
            self.progress.update(failed=1)
            return
        tokens, cost = result["completion_tokens"], result.get("cost") or 0.0
        self.tokens += tokens - est_tokens
        self.cost += cost - est_cost
        self.new_spend[0] += tokens
        self.new_spend[1] += cost
        self._known(tokens, cost)
        self.progress.update(tokens=tokens, cost=result.get("cost"))

    def _priced(self) -> bool:
        j = self.job
        return j.kind == "openai" and (j.max_cost_usd is not None or "max_cost_usd" in j.overall)

    def remaining_estimate(self, misses: int) -> int:
        """Requests still to send, as far as the budgets let us guess."""
        left = misses - self.progress.done
        tokens_per = self.estimate()[0] or 1
        if self.job.token_budget is not None:
            left = min(left, max(0, (self.job.token_budget - self.tokens)) // tokens_per + 1)
        return max(left, len(self.inflight))


# ---------------------------------------------------------------------------- entry points


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
        sent, stopped_by = _dispatch(j, store, misses, threads, quiet)
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


def _dispatch(
    j: Job, store: Store, misses: int, threads: int | None, quiet: bool
) -> tuple[int, str | None]:
    """Run the backend over the misses; return (requests sent, budget that stopped it)."""
    progress = Progress(f"responses {j.dataset}", misses, quiet=quiet)
    store.run_started(j.dataset, j.response_key)
    state = "failed"
    backend = j.generator(threads)
    d = Dispatch(j, backend, store, progress)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            progress.total = progress.done + d.remaining_estimate(misses)
            with contextlib.suppress(sqlite3.Error):  # progress only: a failed answer stops
                store.run_progress(j.dataset, j.response_key, progress.snapshot())
            if j.caps:
                d.refresh_spend()

    async def run() -> None:
        beat = asyncio.create_task(heartbeat())
        try:
            await d.run()
        finally:
            beat.cancel()
            await backend.close()

    try:
        asyncio.run(run())
        state = "done"
    except KeyboardInterrupt:
        state = "interrupted"
        print(
            f"eaglet: responses {j.dataset}: interrupted; {progress.done} answers kept in the "
            f"store, {d.dropped} requests in flight dropped (rerun to continue)",
            file=sys.stderr,
        )
        raise
    except EagletError as e:
        if d.lost:
            raise EagletError(f"{e}; {d.lost} answers paid and not stored") from None
        raise
    finally:
        progress.close()
        with contextlib.suppress(sqlite3.Error):
            store.run_progress(j.dataset, j.response_key, progress.snapshot(), state=state)
    return d.sent, d.stopped_by
