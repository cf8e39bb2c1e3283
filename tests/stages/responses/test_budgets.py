"""The project budget charges a run what its own params file bought: answers imported, and those
of other params files sharing the store, are reported beside and not charged, unless
`budget.count: store`. Against a real loopback OpenAI-style server and real SQLite stores, old
ones included."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.errors import EagletError
from eaglet.formats.io import dumps, read_jsonl
from eaglet.formats.store import Store, charged, store_path
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.params import load
from eaglet.stages.responses.preflight import preflight

from ...conftest import ROOT, write_params
from ...fake_llm import FakeLLM, openai_answer
from .test_generate import CAP, KEY, KEY_ENV, api_params, eaglet, prompts_of


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
def fake():
    server = FakeLLM(api_key=KEY).start()
    yield server
    server.stop()


def write_questions(project: Path, name: str, n: int, word: str) -> str:
    path = project / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "human", "value": f"{word} {i}: what is {i} plus {2 * i}?"}]
            f.write(json.dumps({"conversations": [*turns, {"from": "gpt", "value": "old"}]}) + "\n")
    return f"data/{name}"


def paid(server: FakeLLM) -> int:
    return sum(len(v) for v in server.sent.values())


def prompt_cost(params, ds: str) -> tuple[int, float]:
    """What the server charges for every prompt of `ds` (the fake model's own answers)."""
    answers = [
        openai_answer(p["messages"], CAP) for p in read_jsonl(Keys(params).path("prompts", ds))
    ]
    return sum(a["completion_tokens"] for a in answers), sum(a["cost"] for a in answers)


def test_imported_answers_and_other_params_files_are_reported_beside_not_charged(tmp_path, fake):
    """$10 of imported answers and another params file's answers in the store: under a cap far
    below them, this params file's dataset is generated in full (`this_run`), its own answers
    charged, the others reported beside; with `budget.count: store` the same cap stops it before
    it sends anything."""
    ours = write_questions(tmp_path, "ours.jsonl", 20, "Ours")
    theirs = write_questions(tmp_path, "theirs.jsonl", 12, "Theirs")
    # another params file in the same folder (the same store) buys its own answers
    other = api_params(fake.url, {"b": {"path": theirs, "format": "sharegpt"}})
    (tmp_path / "other.yaml").write_text(json.dumps(other))
    params_other = load(tmp_path / "other.yaml")
    build("prompts", params_other, "b")
    build("responses", params_other, "b", quiet=True)
    b_tokens, b_cost = prompt_cost(params_other, "b")
    # this params file: one dataset, and $10 of answers imported into the store
    data = api_params(fake.url, {"a": {"path": ours, "format": "sharegpt"}})
    write_params(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    build("prompts", params, "a")
    raw = tmp_path / "raw_responses.jsonl"
    with open(raw, "w") as f:
        for i in range(10):
            messages = [
                {"role": "user", "content": f"Imported {i}?"},
                {"role": "assistant", "content": "an answer"},
            ]
            f.write(
                json.dumps({"messages": messages, "usage": {"completion_tokens": 7, "cost": 1.0}})
            )
            f.write("\n")
    eaglet(tmp_path, "import-responses", "a", str(raw))
    a_tokens, a_cost = prompt_cost(params, "a")
    cap = a_cost * 1.5  # far below the $10 imported and above what `a` costs
    assert cap < 10 and cap < a_cost + b_cost + 10

    # budget.count: store (the old rule) charges every answer: the cap is passed already
    data["budget"] = {"max_cost_usd": cap, "count": "store"}
    write_params(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    rep = preflight(params, "a")
    (overall,) = [b for b in rep["budgets"] if b["budget"] == "budget.max_cost_usd"]
    assert overall["used"] == pytest.approx(10 + b_cost)
    sent = paid(fake)
    with pytest.raises(EagletError, match=r"budget\.max_cost_usd reached.* budget\.count: store"):
        build("responses", params, "a", quiet=True)
    assert paid(fake) == sent  # stopped before the first request

    # the default, this_run: nothing of this params file's is in the store yet
    data["budget"] = {"max_cost_usd": cap}
    write_params(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    rep = preflight(params, "a")
    (overall,) = [b for b in rep["budgets"] if b["budget"] == "budget.max_cost_usd"]
    assert overall["used"] == 0  # (its forecast averages the imported answers: $1 each)
    s = rep["spend"]
    assert s["count"] == "this_run" and s["params"] == "params.yaml"
    assert s["imported"] == {"answers": 10, "tokens": 70, "cost": pytest.approx(10.0)}
    assert s["other_runs"]["answers"] == 12 and s["other_runs"]["cost"] == pytest.approx(b_cost)
    assert s["other_runs"]["by_params"]["other.yaml"]["tokens"] == b_tokens
    r = eaglet(tmp_path, "generate", "a", "--dry-run")
    assert "spend (budget.count: this_run): charged $0.0000, 0 tokens" in r.stdout
    assert "beside, not charged: 10 imported ($10.0000, 70 tokens)" in r.stdout
    assert "12 of other params files: other.yaml 12" in r.stdout
    out = build("responses", params, "a", quiet=True)
    assert len(list(read_jsonl(out))) == 20 and paid(fake) == sent + 20
    spend = json.loads(sidecar_of(out).read_text())["stats"]["spend"]
    assert spend["this_run"] == {"answers": 20, "tokens": a_tokens, "cost": pytest.approx(a_cost)}
    assert spend["charged"] == {"tokens": a_tokens, "cost": pytest.approx(a_cost)}
    assert spend["imported"]["answers"] == 10 and spend["other_runs"]["answers"] == 12
    st = eaglet(tmp_path, "status").stdout.splitlines()  # the same split, under the table
    assert (
        f"spend (budget.count: this_run): charged ${a_cost:.4f}, {a_tokens:,} tokens: "
        in "\n".join(st)
    )
    assert "beside, not charged: 10 imported ($10.0000, 70 tokens); 12 of other" in st[-1]

    # and the charge holds back this run: another dataset of this file stops at the cap
    more = write_questions(tmp_path, "more.jsonl", 40, "More")
    data["datasets"]["c"] = {"path": more, "format": "sharegpt"}
    data["backends"]["api"]["concurrency"] = 1
    write_params(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    build("prompts", params, "c")
    with pytest.raises(EagletError, match=r"budget\.max_cost_usd reached.*not charged: 10 impor"):
        build("responses", params, "c", quiet=True)
    store = Store(store_path(tmp_path))
    try:
        parts = store.spend("params.yaml")
    finally:
        store.close()
    per = max(openai_answer(p["messages"], CAP)["cost"] for p in prompts_of(params, "c"))
    assert cap <= parts["this_run"]["cost"] <= cap + 2 * per  # stopped at the cap, + in flight
    assert 20 < parts["this_run"]["answers"] < 60
    assert parts["imported"]["cost"] == pytest.approx(10.0)
    assert parts["other_runs"]["cost"] == pytest.approx(b_cost)


OLD_SCHEMA = """
CREATE TABLE responses (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    result TEXT,
    error TEXT,
    attempts INTEGER NOT NULL,
    completion_tokens INTEGER,
    cost REAL,
    backend TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX responses_backend ON responses (backend, status);
CREATE TABLE rejections (
    key TEXT PRIMARY KEY, kind TEXT NOT NULL, reason TEXT NOT NULL, prompt_tokens INTEGER,
    updated REAL NOT NULL
);
"""


def old_store(path: Path) -> dict[str, dict]:
    """A store as the release before origins wrote it: a generated answer, an imported one (its
    record says so), a failure and a row whose answer is damaged."""

    def result(text: str, cost: float, imported: bool = False) -> dict:
        meta = {"imported": True} if imported else {"id": "gen-1"}
        return {"response": text, "completion_tokens": 5, "cost": cost, "meta": meta}

    rows = {
        "k-generated": ("ok", dumps(result("a generated answer", 0.5)), 5, 0.5),
        "k-imported": ("ok", dumps(result("an imported answer", 2.0, imported=True)), 5, 2.0),
        "k-failed": ("failed", None, None, None),
        "k-damaged": ("ok", '{"response": "cut', 3, 0.25),
    }
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("PRAGMA journal_mode = WAL")
    for key, (status, res, tokens, cost) in rows.items():
        error = "HTTP 503" if status == "failed" else None
        db.execute(
            "INSERT INTO responses VALUES (?, ?, ?, ?, 1, ?, ?, 'b', 0)",
            (key, status, res, error, tokens, cost),
        )
    db.commit()
    db.close()
    return {k: v for k, v in rows.items()}


def test_an_old_store_gains_origins_on_open_and_stays_readable(tmp_path):
    """A store of the release before origins: opened, it gains the columns in one transaction,
    its imported answers are known by their records, the others are of unknown origin (charged
    to a run, as they were then); its answers read back as before, the damaged one still named;
    a second open changes nothing; a new answer records who stored it."""
    from eaglet.formats.store import Origin, StoreError

    path = tmp_path / "responses.sqlite"
    old_store(path)
    store = Store(path, Origin("generated", "params.yaml", "a"))
    try:
        origins = dict(store.db.execute("SELECT key, origin FROM responses"))
        assert origins == {
            "k-generated": "unknown",
            "k-imported": "imported",
            "k-failed": "unknown",
            "k-damaged": "unknown",
        }
        got = store.get_many(["k-generated", "k-imported", "k-failed"])
        assert got["k-generated"]["result"]["response"] == "a generated answer"
        assert got["k-imported"]["cost"] == 2.0 and got["k-failed"]["status"] == "failed"
        with pytest.raises(StoreError, match="k-damaged"):
            store.get_many(["k-damaged"])
        parts = store.spend("params.yaml")
        assert parts["unknown"] == {"answers": 2, "tokens": 8, "cost": 0.75}
        assert parts["imported"] == {"answers": 1, "tokens": 5, "cost": 2.0}
        assert parts["this_run"]["answers"] == parts["other_runs"]["answers"] == 0
        assert charged(parts, "this_run") == (8, 0.75) and charged(parts, "store") == (13, 2.75)
        answer = {"response": "now", "completion_tokens": 4, "cost": 0.125, "attempts": 1}
        store.put("k-failed", "b", answer)  # a failure is replaced, its origin with it
        store.put("k-new", "b", answer | {"completion_tokens": 6, "cost": 0.25})
        row = store.db.execute(
            "SELECT origin, params, dataset, attempts FROM responses WHERE key = 'k-failed'"
        ).fetchone()
        assert row == ("generated", "params.yaml", "a", 2)
        ours = {"answers": 2, "tokens": 10, "cost": 0.375}
        assert store.spend("params.yaml")["this_run"] == ours
        assert store.spend("other.yaml")["other_runs"]["by_params"] == {"params.yaml": ours}
        plan = " ".join(
            str(r)
            for r in store.db.execute(
                "EXPLAIN QUERY PLAN SELECT origin, params, COUNT(*), SUM(completion_tokens), "
                "SUM(cost) FROM responses WHERE status = 'ok' GROUP BY 1, 2"
            )
        )
        assert "responses_spend" in plan  # the spend is read from the index alone
    finally:
        store.close()
    again = Store(path)
    try:
        columns = [r[1] for r in again.db.execute("PRAGMA table_info(responses)")]
        assert columns.count("origin") == 1 and columns[-3:] == ["origin", "params", "dataset"]
        assert again.spend("params.yaml")["unknown"]["answers"] == 2
    finally:
        again.close()


def test_processes_opening_an_old_store_at_once_migrate_it_once(tmp_path):
    """Six processes open one old store at the same moment: each opens it, the columns are added
    once, no row is lost."""
    opener = "import sys, time\nfrom eaglet.formats.store import Store\n"
    opener += "while time.time() < float(sys.argv[2]): pass\nStore(sys.argv[1]).close()"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for round_ in range(4):
        path = tmp_path / f"old-{round_}.sqlite"
        rows = old_store(path)
        start = time.time() + 2.0
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", opener, str(path), str(start)],
                env=env,
                stderr=subprocess.PIPE,
            )
            for _ in range(6)
        ]
        for p in procs:
            assert p.wait() == 0, p.stderr.read().decode()
        db = sqlite3.connect(path)
        columns = [r[1] for r in db.execute("PRAGMA table_info(responses)")]
        assert columns[-3:] == ["origin", "params", "dataset"] and len(columns) == 12
        assert db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == len(rows)
        db.close()
