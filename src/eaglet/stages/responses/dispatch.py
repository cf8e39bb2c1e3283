"""The responses stage's dispatch: the misses of one dataset sent to its backend in prompt
order, within its budgets, each outcome committed to the store before it counts (`Dispatch`),
and the run of it with its progress (`dispatch`)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from dataclasses import dataclass

from eaglet.engines.http import Abort
from eaglet.engines.lookup import Backend
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.store import Store
from eaglet.model.target import load_tokenizer
from eaglet.progress import Progress
from eaglet.stages.responses.job import Job
from eaglet.stages.responses.kernel import rejected
from eaglet.stages.responses.turns import Turn

HEARTBEAT_S = 2.0


@dataclass
class Tally:
    """Completion tokens and dollars summed, and how many answers (or estimates) they sum."""

    tokens: int = 0
    cost: float = 0.0
    answers: int = 0

    def add(self, tokens: int, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost
        self.answers += 1

    def remove(self, tokens: int, cost: float) -> None:
        self.tokens -= tokens
        self.cost -= cost
        self.answers -= 1


class Dispatch:
    """Sends the misses of one dataset in prompt order, within its budgets."""

    def __init__(self, job: Job, backend: Backend, store: Store, progress: Progress):
        self.job, self.backend, self.store, self.progress = job, backend, store, progress
        self.prefix = Tally()  # the prefix so far: actual answers + in-flight estimates
        self.inflight: dict[str, tuple[int, float]] = {}  # key -> its estimate (tokens, cost)
        self.flying = Tally()  # those estimates
        self.known = Tally()  # the answers seen: the estimates' base
        self.spent = Tally(*job.spend(store))  # charged to the project budget (budget.count)
        self.new_spend = Tally()  # this run's answers since `spent` was read
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
        k = self.known
        if k.answers:
            return round(k.tokens / k.answers), k.cost / k.answers
        return self.job.sampling["max_new_tokens"], 0.0

    def over(self, sending: bool) -> str | None:
        """The budget the prefix so far (in-flight answers at their estimate) has passed; the
        project's overall budget counts only before `sending` a request."""
        j = self.job
        if j.token_budget is not None and self.prefix.tokens > j.token_budget:
            return "token_budget"
        if j.max_cost_usd is not None and self.prefix.cost > j.max_cost_usd:
            return "max_cost_usd"
        caps = j.caps
        if not sending or not caps:
            return None
        tokens = self.spent.tokens + self.new_spend.tokens + self.flying.tokens
        cost = self.spent.cost + self.new_spend.cost + self.flying.cost
        if "token_budget" in caps and tokens >= caps["token_budget"]:
            return "budget.token_budget"
        if "max_cost_usd" in caps and cost >= caps["max_cost_usd"]:
            return "budget.max_cost_usd"
        return None

    def refresh_spend(self) -> None:
        """Re-read the project's spend (other processes of this run add to it too)."""
        self.spent, self.new_spend = Tally(*self.job.spend(self.store)), Tally()

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
        self.prefix, self.known = Tally(), Tally()  # the prefix, from the start
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
                        self.prefix.add(row["completion_tokens"], row["cost"] or 0.0)
                        self.known.add(row["completion_tokens"], row["cost"] or 0.0)
                        continue
                    est = self.estimate()
                    self.asked.add(key)
                    self.inflight[key] = est
                    self.prefix.add(*est)
                    self.flying.add(*est)
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
        self.flying.remove(est_tokens, est_cost)
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
        self.prefix.tokens += tokens - est_tokens  # the estimate's answer, now its actual size
        self.prefix.cost += cost - est_cost
        self.new_spend.add(tokens, cost)
        self.known.add(tokens, cost)
        self.progress.update(tokens=tokens, cost=result.get("cost"))

    def _priced(self) -> bool:
        j = self.job
        return j.kind == "openai" and (j.max_cost_usd is not None or "max_cost_usd" in j.overall)

    def remaining_estimate(self, misses: int) -> int:
        """Requests still to send, as far as the budgets let us guess."""
        left = misses - self.progress.done
        tokens_per = self.estimate()[0] or 1
        if self.job.token_budget is not None:
            left = min(left, max(0, (self.job.token_budget - self.prefix.tokens)) // tokens_per + 1)
        return max(left, len(self.inflight))


def dispatch(
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
