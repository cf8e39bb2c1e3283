"""The response store: every answer a backend gave, committed before it counts as done.

One SQLite file per project (`data/cache/responses.sqlite`, WAL mode) shared by every dataset and
every `eaglet generate` process. A row is keyed by the SHA-256 of the request itself: the backend
identity (kind, model, routing; the target's weights for sglang and transformers), the sampling
settings and the messages. So a rerun asks only for what is missing, an identical prompt in two
datasets is paid for once, and moving to another backend or model never reuses old answers.

An `ok` row is never replaced; a `failed` row is replaced by the next attempt's outcome. A
prompt rejected for good (an API's 4xx that another attempt would repeat, or a prompt too long
for the dataset's `max_length`, never sent) is in `rejections` with its reason: it is not sent
again and not part of the output. The `runs` table holds a heartbeat of each generation in
progress, read by `eaglet status`; `lock` keeps one `eaglet generate` per dataset at a time.

Each row records where its answer came from: `origin` (`generated` by `eaglet generate`,
`imported` by `eaglet import-responses`), the params file (its name) and the dataset that
stored it. So the project budget can charge a run for what its own params file bought, and
report imported answers and other params files' beside (`spend`). Stores written before origins
were recorded gain the columns on first open (one transaction: all of it or none); their rows
are `imported` where the record says so (`meta.imported`), else `unknown`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglet import locks
from eaglet.atomic import atomic_path
from eaglet.errors import EagletError
from eaglet.formats.io import dumps

BUSY_TIMEOUT_MS = 60_000
CHUNK = 500  # keys per SELECT ... IN (...)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    result TEXT,
    error TEXT,
    attempts INTEGER NOT NULL,
    completion_tokens INTEGER,
    cost REAL,
    backend TEXT NOT NULL,
    updated REAL NOT NULL,
    origin TEXT,
    params TEXT,
    dataset TEXT
);
CREATE INDEX IF NOT EXISTS responses_backend ON responses (backend, status);
CREATE TABLE IF NOT EXISTS rejections (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL,
    prompt_tokens INTEGER,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    dataset TEXT NOT NULL,
    key TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started REAL NOT NULL,
    updated REAL NOT NULL,
    state TEXT NOT NULL,
    progress TEXT NOT NULL,
    PRIMARY KEY (dataset, key)
);
"""


# Added after the first release: an older store gains them on open (Store._migrate).
ORIGIN_COLUMNS = {"origin": "TEXT", "params": "TEXT", "dataset": "TEXT"}
SPEND_INDEX = (
    "CREATE INDEX IF NOT EXISTS responses_spend "
    "ON responses (status, origin, params, completion_tokens, cost)"
)
# An imported answer's record, as `eaglet import-responses` writes it (canonical JSON).
IMPORTED_MARK = '"meta":{"imported":true'
SPEND_PARTS = ("this_run", "other_runs", "imported", "unknown")


@dataclass(frozen=True)
class Origin:
    """Who stores the answers of a connection: `how` (generated, imported), the params file
    (its name: the run) and the dataset."""

    how: str
    params: str | None = None
    dataset: str | None = None


def store_path(root: Path) -> Path:
    """The project's store: under the params file's directory."""
    return Path(root) / "data" / "cache" / "responses.sqlite"


class RequestKeys:
    """Request key = sha256(identity, sampling, messages); the first two are fixed per dataset."""

    def __init__(self, identity: dict, sampling: dict):
        self.prefix = dumps({"identity": identity, "sampling": sampling})
        self.backend = hashlib.sha256(dumps(identity).encode()).hexdigest()[:16]

    def __call__(self, messages: list[dict], mode: dict | None = None) -> str:
        """`mode`: the template arguments of the mode asked for; the template's default (None)
        keys as before modes existed, so answers stored then are found again."""
        text = f"{self.prefix}\0{dumps(messages)}"
        if mode:
            text += f"\0{dumps(mode)}"
        return hashlib.sha256(text.encode()).hexdigest()


def _when_unlocked(statement) -> None:
    """Run a statement that SQLite answers "database is locked" without waiting (switching a
    new file to WAL while another process opens it): again, until the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            statement()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Store:
    """One connection to the store (one per process; used from one thread). `origin`: who
    stores its answers (None: not said, recorded as `unknown`)."""

    def __init__(self, path: Path, origin: Origin | None = None):
        self.path, self.origin = Path(path), origin
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _when_unlocked(lambda: self.db.execute("PRAGMA journal_mode = WAL"))
        self.db.execute("PRAGMA synchronous = NORMAL")  # WAL: survives kill -9, not power loss
        _when_unlocked(lambda: self.db.executescript(_SCHEMA))
        self.origins = False  # whether the store records origins (see _migrate)
        _when_unlocked(self._migrate)

    def _migrate(self) -> None:
        """Give a store written before origins were recorded its origin columns and the spend
        index, in one transaction (a kill leaves the old store, never half of the new one). Its
        rows are `imported` where their record says so, else `unknown`. Sets `origins`: whether
        the store has the columns (not: an old store this process cannot write, read as old)."""

        def done() -> bool:
            have = {row[1] for row in self.db.execute("PRAGMA table_info(responses)")}
            index = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'responses_spend'"
            ).fetchone()
            return set(ORIGIN_COLUMNS) <= have and index is not None

        if done():
            self.origins = True
            return
        try:
            with self.transaction():
                if done():  # another process migrated it meanwhile
                    self.origins = True
                    return
                have = {row[1] for row in self.db.execute("PRAGMA table_info(responses)")}
                for name, kind in ORIGIN_COLUMNS.items():
                    if name not in have:
                        self.db.execute(f"ALTER TABLE responses ADD COLUMN {name} {kind}")
                self.db.execute(
                    "UPDATE responses SET origin = CASE WHEN instr(result, ?) > 0 "
                    "THEN 'imported' ELSE 'unknown' END WHERE origin IS NULL",
                    (IMPORTED_MARK,),
                )
                self.db.execute(SPEND_INDEX)
        except sqlite3.OperationalError as e:
            if "readonly" not in str(e):
                raise
            return
        self.origins = True

    def close(self) -> None:
        self.db.close()

    def snapshot(self, dest: Path) -> Path:
        """A consistent copy of the store at `dest` (SQLite's online backup: other processes
        may write meanwhile), written atomically: what `make store` versions in DVC."""
        with atomic_path(dest) as tmp:
            copy = sqlite3.connect(tmp)
            try:
                self.db.backup(copy)
                copy.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
            finally:
                copy.close()
        return Path(dest)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction: all of the block's writes, or none."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ------------------------------------------------------------------ responses
    def get_many(self, keys: Iterable[str]) -> dict[str, dict]:
        """Rows for the keys that have one: {key: {status, result, error, attempts, ...}}."""
        keys = list(keys)
        out: dict[str, dict] = {}
        for i in range(0, len(keys), CHUNK):
            part = keys[i : i + CHUNK]
            marks = ",".join("?" * len(part))
            for key, status, result, error, attempts, tokens, cost in self.db.execute(
                "SELECT key, status, result, error, attempts, completion_tokens, cost "
                f"FROM responses WHERE key IN ({marks})",
                part,
            ):
                try:
                    result = json.loads(result) if result else None
                except ValueError:
                    raise StoreError(
                        f"{self.path}: the answer under key {key[:16]} is unreadable (damaged "
                        "row); delete that row to ask again"
                    ) from None
                out[key] = {
                    "status": status,
                    "result": result,
                    "error": error,
                    "attempts": attempts,
                    "completion_tokens": tokens,
                    "cost": cost,
                }
            for key, kind, reason, prompt_tokens in self.db.execute(
                f"SELECT key, kind, reason, prompt_tokens FROM rejections WHERE key IN ({marks})",
                part,
            ):
                row = out.setdefault(key, {"status": "failed", "result": None, "attempts": 0})
                if row["status"] != "ok":  # an answer wins over an old rejection
                    row["status"] = "rejected"
                    row["error"] = reason
                    row["rejected"] = {"kind": kind, "prompt_tokens": prompt_tokens}
        return out

    def reject(self, key: str, kind: str, reason: str, prompt_tokens: int | None = None) -> None:
        """Record a prompt rejected for good: `api` (a 4xx no retry changes), `too_long`."""
        self.db.execute(
            "INSERT OR REPLACE INTO rejections VALUES (?, ?, ?, ?, ?)",
            (key, kind, reason, prompt_tokens, time.time()),
        )

    def unreject(self, key: str) -> None:
        self.db.execute("DELETE FROM rejections WHERE key = ?", (key,))

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold `name` (a dataset) for this process: a second holder is refused, naming the
        first; the OS drops the lock when its holder exits, kill -9 included."""
        held = contextlib.ExitStack()
        try:
            held.enter_context(
                locks.hold(self.path.parent / "locks" / f"{name}.lock", f"eaglet generate {name}")
            )
        except locks.Locked as e:
            raise Locked(f"{name}: another eaglet generate is running ({e})") from None
        with held:
            yield

    def put(self, key: str, backend: str, result: dict) -> None:
        """Commit one outcome: an answer (`result` without "error") or a failure after retries,
        with the connection's origin. A failure never replaces an answer; attempts add up across
        runs."""
        failed = "error" in result
        origin = self.origin or Origin("unknown")
        self.db.execute(
            "INSERT INTO responses (key, status, result, error, attempts, completion_tokens, "
            "cost, backend, updated, origin, params, dataset) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET status = excluded.status, result = excluded.result, "
            "error = excluded.error, attempts = responses.attempts + excluded.attempts, "
            "completion_tokens = excluded.completion_tokens, cost = excluded.cost, "
            "updated = excluded.updated, origin = excluded.origin, params = excluded.params, "
            "dataset = excluded.dataset WHERE responses.status = 'failed'",
            (
                key,
                "failed" if failed else "ok",
                None if failed else dumps(result),
                result["error"] if failed else None,
                result["attempts"],
                None if failed else result["completion_tokens"],
                None if failed else result.get("cost"),
                backend,
                time.time(),
                origin.how,
                origin.params,
                origin.dataset,
            ),
        )

    def totals(self) -> tuple[int, float]:
        """Completion tokens and dollars of every answer in the store: the project's spend."""
        tokens, cost = self.db.execute(
            "SELECT COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost), 0.0) "
            "FROM responses WHERE status = 'ok'"
        ).fetchone()
        return int(tokens), float(cost)

    def spend(self, params: str | None) -> dict:
        """The answers in the store in four parts, each {"answers", "tokens", "cost"}:
        `this_run` (generated under the params file named `params`), `other_runs` (generated
        under other params files, with `by_params`: each one's part), `imported`, and `unknown`
        (stored before origins were recorded, or by a writer that did not say)."""
        parts: dict = {p: _zero() for p in SPEND_PARTS}
        others: dict[str, dict] = {}
        if self.origins:
            origin, by, args = "COALESCE(origin, 'unknown')", "params", ()
        else:  # an old store this process cannot migrate: what its records say
            origin = "CASE WHEN instr(result, ?) > 0 THEN 'imported' ELSE 'unknown' END"
            by, args = "NULL", (IMPORTED_MARK,)
        for how, name, n, tokens, cost in self.db.execute(
            f"SELECT {origin}, {by}, COUNT(*), COALESCE(SUM(completion_tokens), 0), "
            "COALESCE(SUM(cost), 0.0) FROM responses WHERE status = 'ok' GROUP BY 1, 2",
            args,
        ):
            if how == "generated":
                part = "this_run" if name == params else "other_runs"
            else:
                part = how if how == "imported" else "unknown"
            adds = [parts[part]]
            if part == "other_runs":
                adds.append(others.setdefault(name or "?", _zero()))
            for add in adds:
                add["answers"] += n
                add["tokens"] += int(tokens)
                add["cost"] += float(cost)
        parts["other_runs"]["by_params"] = others
        return parts

    def history(self, backend: str) -> dict:
        """Answers this backend identity gave so far: count, mean tokens, mean cost."""
        n, tokens, cost, priced = self.db.execute(
            "SELECT COUNT(*), AVG(completion_tokens), AVG(cost), COUNT(cost) FROM responses "
            "WHERE backend = ? AND status = 'ok'",
            (backend,),
        ).fetchone()
        return {"answers": n, "mean_tokens": tokens, "mean_cost": cost if priced else None}

    # ------------------------------------------------------------------ runs
    def run_started(self, dataset: str, key: str) -> None:
        now = time.time()
        self.db.execute(
            "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, 'running', '{}')",
            (dataset, key, socket.gethostname(), os.getpid(), now, now),
        )

    def run_progress(self, dataset: str, key: str, progress: dict, state: str = "running"):
        self.db.execute(
            "UPDATE runs SET updated = ?, state = ?, progress = ? "
            "WHERE dataset = ? AND key = ? AND pid = ?",
            (time.time(), state, dumps(progress), dataset, key, os.getpid()),
        )

    def run(self, dataset: str, key: str) -> dict | None:
        """The last run of (dataset, key), with `alive` telling whether it is still going."""
        row = self.db.execute(
            "SELECT host, pid, started, updated, state, progress FROM runs "
            "WHERE dataset = ? AND key = ?",
            (dataset, key),
        ).fetchone()
        if row is None:
            return None
        host, pid, started, updated, state, progress = row
        alive = state == "running" and host == socket.gethostname() and locks.pid_alive(pid)
        return {
            "pid": pid,
            "started": started,
            "updated": updated,
            "state": state if alive or state != "running" else "interrupted",
            "alive": alive,
            **json.loads(progress),
        }


def _zero() -> dict:
    return {"answers": 0, "tokens": 0, "cost": 0.0}


def charged(parts: dict, count: str) -> tuple[int, float]:
    """Completion tokens and dollars the project budget charges (`budget.count`): `this_run`,
    the answers this params file generated plus those of unknown origin (stored before origins
    were recorded: every answer counted then, and whose they were is not known), never imported
    ones nor other params files'; `store`, every answer in the store."""
    names = SPEND_PARTS if count == "store" else ("this_run", "unknown")
    return (
        sum(parts[n]["tokens"] for n in names),
        sum(parts[n]["cost"] for n in names),
    )


class StoreError(EagletError):
    """The store holds something it cannot read back."""


class Locked(Exception):
    """The dataset is held by another generation."""
