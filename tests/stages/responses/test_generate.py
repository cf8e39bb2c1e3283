"""The generation engine against real loopback servers speaking OpenAI/OpenRouter and SGLang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from eaglet.engines.http import retry_after
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.io import read_jsonl
from eaglet.formats.records import RESPONSE_FIELDS
from eaglet.formats.store import Store, store_path
from eaglet.graph.keys import Keys, build, resolve_stage, sidecar_of
from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
from eaglet.params import load
from eaglet.reports import status
from eaglet.stages.responses.preflight import preflight

from ... import cli
from ...conftest import ROOT, write_params
from ...fake_llm import FakeLLM, chat_digest, openai_answer, sglang_answer

KEY = "sk-or-v1-test-4f1e9c0b7a"
KEY_ENV = "EAGLET_TEST_KEY"
CAP = 16


@pytest.fixture
def server():
    fakes = []

    def start(**kw) -> FakeLLM:
        kw.setdefault("api_key", KEY)
        fakes.append(FakeLLM(**kw).start())
        return fakes[-1]

    yield start
    for f in fakes:
        f.stop()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def write_raw(project: Path, n: int, name: str = "raw.jsonl") -> Path:
    path = project / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"from": "human", "value": f"Question {i}: what is {i} times {i + 3}?"},
                {"from": "gpt", "value": "an old answer"},
            ]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def api_params(url: str, datasets: dict, **backend) -> dict:
    cfg = {
        "kind": "openai",
        "base_url": f"{url}/v1",
        "model": "fake/model-1",
        "api_key_env": KEY_ENV,
        "concurrency": 16,
        "timeout_s": 10,
        "backoff_s": 0.01,
        "backoff_max_s": 0.05,
        "provider": {"order": ["prov-a"], "allow_fallbacks": False},
    }
    cfg.update(backend)
    return {
        "target": {"model": SMOLLM2},
        "backends": {"api": cfg},
        # the fake model's answers often reach CAP: kept, these tests are about the store
        "generation": {"backend": "api", "max_new_tokens": CAP, "truncated": "keep"},
        "datasets": datasets,
    }


def setup(project: Path, data: dict, *datasets: str):
    write_params(project, data)
    params = load(project / "params.yaml")
    for ds in datasets or params.datasets:
        build("prompts", params, ds)
    return params


def eaglet(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The project's command line (tests/cli.py; test_status and test_budgets import this)."""
    return cli.eaglet(*args, params=project / "params.yaml", check=check)


def records(params, ds: str) -> list[dict]:
    return list(read_jsonl(Keys(params).path("responses", ds)))


def assert_sent(fake: FakeLLM, rec: dict, cap: int = CAP) -> None:
    """The record holds exactly what the server answered for its messages."""
    sent = fake.sent[chat_digest(rec["messages"], cap)]
    assert sent, rec["id"]
    want = openai_answer(rec["messages"], cap)
    assert rec["response"] == want["text"] == sent[-1]["choices"][0]["message"]["content"]
    assert rec["completion_tokens"] == rec["server_completion_tokens"] == want["completion_tokens"]
    assert rec["cost"] == want["cost"] and rec["finish_reason"] == want["finish_reason"]
    # the stream SmolLM2 emitted: the answer, then its end of turn unless cut by the cap
    end = "<|im_end|>" if want["finish_reason"] == "stop" else ""
    assert _tok().decode(rec["output_ids"]) == want["text"] + end


@cache  # one load for the whole module: resolving hashes the GGUF, 0.4 s a call, 2,000 calls
def _tok():
    return load_tokenizer(resolve(SMOLLM2))


# ---------------------------------------------------------------------------- the must-shows


@pytest.mark.slow
def test_faulty_server_kill9_then_rerun_gives_every_answer_once(tmp_path, server):
    faults = {"429": 0.10, "500": 0.03, "503": 0.02, "truncated": 0.03, "drop": 0.03}
    fake = server(faults=faults, seed=7, latency=0.005)
    n = 2000
    write_raw(tmp_path, n)
    data = api_params(fake.url, {"big": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"]["api"]["concurrency"] = 64
    params = setup(tmp_path, data)
    proc = subprocess.Popen(
        cli.command("generate", "big", "--quiet", params=tmp_path / "params.yaml"),
        cwd=tmp_path,
        env=cli.environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while len(fake.sent) < 700 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    live = status.collect(params)[1]["generation"]  # read while the other process writes
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    out = Keys(params).path("responses", "big")
    assert not out.exists()
    assert 0 < live["done"] < n and live["run"]["state"] == "running"
    after_kill = status.collect(params)[1]["generation"]
    assert after_kill["run"]["state"] == "interrupted" and after_kill["done"] >= live["done"]
    paid_before = sum(len(v) for v in fake.sent.values())

    r = eaglet(tmp_path, "generate", "big", "--quiet")
    assert r.stdout.strip() == str(out)
    recs = records(params, "big")
    want_ids = [p["id"] for p in read_jsonl(Keys(params).path("prompts", "big"))]
    assert [x["id"] for x in recs] == want_ids and len(set(want_ids)) == n
    for rec in recs:
        assert set(rec) == set(RESPONSE_FIELDS) and rec["backend"] == "api"
        assert_sent(fake, rec)
    expect = [openai_answer(x["messages"], CAP) for x in recs]
    side = json.loads(sidecar_of(out).read_text())["stats"]
    assert side["responses"] == n
    assert side["completion_tokens"] == sum(e["completion_tokens"] for e in expect)
    assert side["cost"] == pytest.approx(sum(e["cost"] for e in expect), rel=1e-9)
    # every answer stored before the kill is reused (those in flight were paid, never stored)
    assert side["requests_sent"] == n - side["store_hits"] and side["store_hits"] >= live["done"]
    # answers paid twice: at most those in flight at the kill (concurrency 64)
    paid = sum(len(v) for v in fake.sent.values())
    assert n <= paid <= n + 64 and paid_before <= n
    assert all(fake.faulted[k] > 0 for k in faults)
    assert max(x["attempts"] for x in recs) > 1
    # the API key is in no file under the project, store and its WAL included
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_token_budget_output_is_the_longest_prefix_that_fits(tmp_path, server):
    fake = server()
    write_raw(tmp_path, 60)
    budget = 150
    ds = {"path": "data/raw.jsonl", "format": "sharegpt", "token_budget": budget}
    params = setup(tmp_path, api_params(fake.url, {"b": ds}, concurrency=8))
    out = build("responses", params, "b", quiet=True)
    recs = list(read_jsonl(out))
    total = sum(r["completion_tokens"] for r in recs)
    order = list(read_jsonl(Keys(params).path("prompts", "b")))
    assert [r["id"] for r in recs] == [p["id"] for p in order[: len(recs)]]
    nxt = openai_answer(order[len(recs)]["messages"], CAP)["completion_tokens"]
    assert total <= budget < total + nxt
    assert json.loads(sidecar_of(out).read_text())["stats"]["stopped_by"] == "token_budget"
    sent = len(fake.sent)
    assert sent <= len(recs) + 1 + 8  # what was in flight when the budget was reached
    # same store, any concurrency: the same file; a larger budget sends only what it lacks
    first = out.read_bytes()
    out.unlink()
    data = api_params(fake.url, {"b": ds}, concurrency=1)
    write_params(tmp_path, data)
    assert build("responses", load(tmp_path / "params.yaml"), "b", quiet=True).read_bytes() == first
    assert len(fake.sent) == sent
    ds["token_budget"] = 10**6
    params = setup(tmp_path, api_params(fake.url, {"b": ds}, concurrency=8))
    build("responses", params, "b", quiet=True)
    assert len(records(params, "b")) == 60
    assert sum(len(v) for v in fake.sent.values()) == 60  # nothing asked twice


def test_overall_budget_stops_dispatch_and_keeps_answers(tmp_path, server):
    fake = server()
    write_raw(tmp_path, 40)
    data = api_params(fake.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"]["api"]["concurrency"] = 2
    data["budget"] = {"max_cost_usd": 0.0003}
    params = setup(tmp_path, data)
    with pytest.raises(EagletError, match=r"not generated.*budget\.max_cost_usd reached"):
        build("responses", params, "a", quiet=True)
    store = Store(store_path(tmp_path))
    spent = store.totals()[1]
    (per,) = store.db.execute("SELECT MAX(cost) FROM responses").fetchone()
    store.close()
    assert 0.0003 <= spent <= 0.0003 + 2 * per  # what was in flight at the stop finished
    assert 0 < len(fake.sent) < 40
    assert not Keys(params).path("responses", "a").exists()


def test_identical_prompts_are_paid_once_and_processes_share_the_store(tmp_path, server):
    fake = server(latency=0.01)
    write_raw(tmp_path, 30)
    sg = {"path": "data/raw.jsonl", "format": "sharegpt"}
    data = api_params(fake.url, {"x": {**sg, "max_samples": 20}, "y": {**sg, "max_samples": 30}})
    params = setup(tmp_path, data)
    procs = [  # two generations at once on one store
        subprocess.Popen(
            cli.command("generate", ds, "--quiet", params=tmp_path / "params.yaml"),
            cwd=tmp_path,
            env=cli.environ(),
            stderr=subprocess.PIPE,
        )
        for ds in ("x", "y")
    ]
    for p in procs:
        assert p.wait() == 0, p.stderr.read().decode()
    x, y = records(params, "x"), records(params, "y")
    assert len(x) == 20 and len(y) == 30
    for rec in x + y:
        assert_sent(fake, rec)
    assert len(fake.sent) == 30  # 30 distinct prompts asked; racing processes may both ask one
    # a new dataset over the same prompts and a changed max_samples: nothing new to pay
    before = sum(len(v) for v in fake.sent.values())
    data["datasets"]["x"]["max_samples"] = 25
    params = setup(tmp_path, data, "x")
    build("responses", params, "x", quiet=True)
    assert len(records(params, "x")) == 25
    assert sum(len(v) for v in fake.sent.values()) == before


def test_processes_opening_a_new_store_at_once_all_open_it(tmp_path):
    """Switching a new file to WAL answers "database is locked" at once, without waiting, to a
    process that races another for it. A race: without the retry, this failed in 2 runs of 3
    here (2-6 of its 90 opens)."""
    opener = "import sys, time\nfrom eaglet.formats.store import Store\n"
    opener += "while time.time() < float(sys.argv[2]): pass\nStore(sys.argv[1]).close()"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for round_ in range(15):
        path, start = tmp_path / f"store-{round_}.sqlite", time.time() + 1.5
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
        store = Store(path)
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        store.close()


# ---------------------------------------------------------------------------- retries


def test_retry_policy_against_injected_faults(tmp_path, server):
    faults = {"429": 0.2, "402": 0.1, "500": 0.1, "error200": 0.1, "truncated": 0.1, "drop": 0.1}
    fake = server(faults=faults, max_faults=2, seed=3)
    fake.keep_bodies = True
    write_raw(tmp_path, 40)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt", "max_new_tokens": 3}
    params = setup(tmp_path, api_params(fake.url, {"a": ds}, reasoning={"effort": "none"}))
    build("responses", params, "a", quiet=True)
    recs = records(params, "a")
    assert len(recs) == 40
    for rec in recs:
        assert_sent(fake, rec, cap=3)
        assert rec["reasoning"] is None
        attempts = fake.attempts[chat_digest(rec["messages"], 3)]
        assert rec["attempts"] == attempts  # every attempt counted, and one answer kept
    assert all(fake.faulted[k] for k in faults)
    length = [r for r in recs if r["finish_reason"] == "length"]
    assert length and all(len(fake.sent[chat_digest(r["messages"], 3)]) == 1 for r in length)
    body = fake.bodies[0]  # passthrough: provider routing and reasoning; the cap always sent
    assert body["provider"] == {"order": ["prov-a"], "allow_fallbacks": False}
    assert body["reasoning"] == {"effort": "none"} and body["max_tokens"] == 3
    assert body["model"] == "fake/model-1"


def test_retry_after_is_honoured_and_pauses_the_backend(tmp_path, server):
    fake = server(faults={"429": 1.0}, max_faults=1, retry_after="1")
    write_raw(tmp_path, 4)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt"}
    params = setup(tmp_path, api_params(fake.url, {"a": ds}, concurrency=4, backoff_s=0.001))
    build("responses", params, "a", quiet=True)
    first = min(t[0] for t in fake.times.values())
    for times in fake.times.values():
        assert len(times) == 2 and times[1] - first >= 0.95
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after("2.5") == 2.5


def test_slow_answers_time_out_and_are_retried(tmp_path, server):
    fake = server(faults={"slow": 0.3}, max_faults=1, slow_s=1.5, seed=1)
    write_raw(tmp_path, 12)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt"}
    params = setup(tmp_path, api_params(fake.url, {"a": ds}, timeout_s=0.5))
    build("responses", params, "a", quiet=True)
    recs = records(params, "a")
    assert fake.faulted["slow"] > 0 and len(recs) == 12
    assert sum(r["attempts"] == 2 for r in recs) == fake.faulted["slow"]


def test_failed_prompts_are_retried_by_a_rerun_and_rejected_ones_excluded(tmp_path, server):
    """503s past the retries fail the run and are sent again by the next; a 400 (context length,
    moderation) is rejected for good: recorded with its reason, never sent again, left out of
    the output and counted, and the stage finishes."""
    fake = server(faults={"400": 0.3, "503": 0.3}, max_faults=10, seed=5)
    write_raw(tmp_path, 20)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt"}
    params = setup(tmp_path, api_params(fake.url, {"a": ds}, max_retries=1))
    with pytest.raises(EagletError, match=r"failed \(first: [0-9a-f]{16}: HTTP 503"):
        build("responses", params, "a", quiet=True)
    assert not Keys(params).path("responses", "a").exists()
    g = status.collect(params)[1]["generation"]
    assert g["failed"] > 0 and g["rejected"] == fake.faulted["400"] > 0
    assert g["done"] + g["failed"] + g["rejected"] == 20
    fake.faults = {}  # the server recovers
    sent_before = sum(fake.attempts.values())
    out = build("responses", params, "a", quiet=True)
    assert sum(fake.attempts.values()) - sent_before == g["failed"]  # the rejected: not again
    recs = records(params, "a")
    assert len(recs) == 20 - g["rejected"] and sum(r["attempts"] > 1 for r in recs) >= g["failed"]
    for rec in recs:
        assert_sent(fake, rec)
    stats = json.loads(sidecar_of(out).read_text())["stats"]
    assert stats["rejected"] == {"api": g["rejected"], "too_long": 0}
    assert "HTTP 400" in stats["first_rejected"]["api"]


def test_bad_key_stops_the_run_without_leaking_it(tmp_path, server, monkeypatch):
    fake = server()
    write_raw(tmp_path, 40)
    write_params(tmp_path, api_params(fake.url, {"a": {"path": "data/raw.jsonl"}}, concurrency=2))
    eaglet(tmp_path, "prompts", "a")
    monkeypatch.setenv(KEY_ENV, "sk-wrong-key-0000")
    r = eaglet(tmp_path, "generate", "a", "--quiet", check=False)
    assert r.returncode == 2 and "HTTP 401" in r.stderr and f"${KEY_ENV}" in r.stderr
    assert "sk-wrong-key-0000" not in r.stderr + r.stdout
    assert fake.requests <= 4  # the run stopped instead of trying every prompt
    monkeypatch.delenv(KEY_ENV)
    r = eaglet(tmp_path, "generate", "a", check=False)
    assert r.returncode == 2 and f"{KEY_ENV} (api_key_env) is not set" in r.stderr


# ---------------------------------------------------------------------------- preflight


def test_dry_run_checks_the_backend_and_counts_store_misses(tmp_path, server):
    fake = server()
    write_raw(tmp_path, 30)
    sg = {"path": "data/raw.jsonl", "format": "sharegpt"}
    data = api_params(fake.url, {"a": {**sg, "max_samples": 10}, "b": {**sg, "token_budget": 100}})
    params = setup(tmp_path, data)
    build("responses", params, "a", quiet=True)
    posts = fake.requests
    rep = preflight(params, "b")
    assert fake.requests - posts == 2 and len(fake.sent) == 10  # two GETs, no generation
    assert rep["store"]["ok"] == 10 and rep["requests"] == 20
    assert rep["check"]["model_served"] and rep["check"]["key"] == "valid"
    assert rep["check"]["credit"] == {"limit": 10.0, "remaining": 10.0}
    assert rep["tokens"]["max"] == 20 * CAP and rep["tokens"]["history_answers"] == 10
    assert 0 < rep["cost"]["expected"] <= rep["cost"]["max"]
    (budget,) = rep["budgets"]
    assert budget["budget"] == "token_budget" and budget["stops_run"]
    r = eaglet(tmp_path, "generate", "b", "--dry-run")
    assert "requests to send: 20" in r.stdout and "credit: $10.00 left" in r.stdout
    fake.stop()
    time.sleep(0.1)
    r = eaglet(tmp_path, "generate", "b", "--dry-run", check=False)
    assert r.returncode == 2 and "unreachable" in r.stderr


# ---------------------------------------------------------------------------- sglang


def test_sglang_generate_sends_the_targets_own_prompt_ids(tmp_path, server):
    fake = server(faults={"500": 0.2, "drop": 0.1}, max_faults=1, api_key=None)
    fake.keep_bodies = True
    write_raw(tmp_path, 12)
    data = api_params(fake.url, {"s": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"] = {
        "sg": {"kind": "sglang", "url": fake.url, "concurrency": 4, "backoff_s": 0.01},
        "sgchat": {"kind": "sglang", "url": fake.url, "endpoint": "chat", "backoff_s": 0.01},
    }
    data["generation"]["backend"] = "sg"
    data["datasets"]["c"] = {"path": "data/raw.jsonl", "format": "sharegpt", "backend": "sgchat"}
    params = setup(tmp_path, data)
    build("responses", params, "s", quiet=True)
    tok = load_tokenizer(resolve(SMOLLM2))
    for rec in records(params, "s"):
        ids = prompt_ids(tok, rec["messages"])
        want = sglang_answer(ids, CAP)
        assert rec["output_ids"] == want["output_ids"] and rec["response"] == want["text"]
        assert rec["completion_tokens"] == len(want["output_ids"])
        assert rec["finish_reason"] == want["meta_info"]["finish_reason"]["type"]
        assert rec["model"] == SMOLLM2 and rec["cost"] is None
    sent = [b for b in fake.bodies if "input_ids" in b]
    assert all(b["sampling_params"]["max_new_tokens"] == CAP for b in sent)
    out = build("responses", params, "c", quiet=True)  # the chat route: other keys, no reuse
    chat = records(params, "c")
    assert len(chat) == 12
    for rec in chat:  # text back: written in SmolLM2's grammar (ChatML), its own tokens
        want = openai_answer(rec["messages"], CAP)
        assert rec["response"] == want["text"]
        end = "<|im_end|>" if want["finish_reason"] == "stop" else ""
        assert rec["output_ids"] == tok(want["text"] + end, add_special_tokens=False)["input_ids"]
    stats = json.loads(sidecar_of(out).read_text())["stats"]
    assert stats["from_grammar"] == 12 and stats["token_drift"]["drift"] == 0


def test_unreachable_server_is_a_clean_failure(tmp_path):
    write_raw(tmp_path, 3)
    data = api_params("http://127.0.0.1:9", {"a": {"path": "data/raw.jsonl"}}, max_retries=1)
    params = setup(tmp_path, data)
    with pytest.raises(EagletError, match=r"3 failed \(first: .*connection failed"):
        build("responses", params, "a", quiet=True)


def test_an_answer_the_targets_grammar_cannot_write_stops_naming_it(tmp_path, server):
    """SmolLM2 (ChatML) has no reasoning: an API that answers with some is not serving it. The
    stage stops with the record's id and writes nothing; the paid answers stay in the store."""
    fake = server()
    write_raw(tmp_path, 3)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt"}
    params = setup(tmp_path, api_params(fake.url, {"a": ds}, reasoning={"effort": "low"}))
    first = prompts_of(params, "a")[0]
    with pytest.raises(
        EagletError, match=rf"response {first['id']}: chatml grammar: .*no reasoning"
    ):
        build("responses", params, "a", quiet=True)
    assert not Keys(params).path("responses", "a").exists()
    store = Store(store_path(params.root))
    try:
        assert (
            sum(r["status"] == "ok" for r in store.get_many(store_keys(params, "a")).values()) == 3
        )
    finally:
        store.close()


def prompts_of(params, ds: str) -> list[dict]:
    return list(read_jsonl(Keys(params).path("prompts", ds)))


def store_keys(params, ds: str) -> list[str]:
    _, job = resolve_stage("responses", params, ds)
    return [job.keyfn(p["messages"]) for p in prompts_of(params, ds)]


# The dry run under a watch: Python's audit hook records every child process it starts, and at
# the end every model class module of transformers it imported (a model is built from one; a
# tokenizer never imports one; `auto` holds only the mappings) is added, however it ends.
WATCHED = r"""
import json, sys
seen = []
def hook(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec",
                 "os.spawn", "os.system"):
        seen.append([event, repr(args)[:300]])
sys.addaudithook(hook)
from eaglet.cli import main
try:
    code = main(sys.argv[2:])
finally:
    seen += [["module", m] for m in sorted(sys.modules)
             if m.startswith("transformers.models.") and ".modeling_" in m
             and not m.startswith("transformers.models.auto.")]
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
sys.exit(code)
"""


def watched(project: Path, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    """`eaglet ARGS` under the watch: its result and what the watch saw."""
    events = project / "events.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-c", WATCHED, str(events), *args]
    cmd += ["--params", str(project / "params.yaml")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=project, env=env, timeout=300)
    return r, json.loads(events.read_text())


@pytest.mark.parametrize("kind", ["vllm", "transformers"])
def test_dry_run_of_a_managed_engine_or_in_process_target_loads_nothing(tmp_path, kind):
    """`generate --dry-run` with a vLLM engine eaglet would start, or the in-process target:
    no child process started, no model built, and one `not checked:` line naming what only the
    run can check; the tokenizer and template are checked (they load without the model), the
    store and the budget counted. The watch is real: the run itself trips it."""
    write_raw(tmp_path, 3)
    engine = {"kind": kind} if kind == "vllm" else {"kind": "transformers", "device": "cpu"}
    data = {
        "target": {"model": SMOLLM2},
        "backends": {"engine": engine},
        "generation": {"backend": "engine", "max_new_tokens": 8, "truncated": "keep"},
        "budget": {"token_budget": 1000},
        "datasets": {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}},
    }
    params = setup(tmp_path, data)
    t0 = time.monotonic()
    r, events = watched(tmp_path, "generate", "a", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert events == []  # no engine, no model: nothing was started or built
    assert time.monotonic() - t0 < 120
    out = r.stdout
    (line,) = [x for x in out.splitlines() if x.startswith("  not checked:")]
    if kind == "vllm":
        assert "the managed vLLM engine is not started by --dry-run" in line
        assert "`eaglet generate a` starts it" in line
        assert "backend: a vLLM engine eaglet starts for the run" in out
    else:
        assert "the in-process target" in line and "is not loaded by --dry-run" in line
    assert SMOLLM2 in line
    first = prompts_of(params, "a")[0]
    tokens = len(prompt_ids(_tok(), first["messages"]))
    assert f"chat template renders prompt {first['id']} ({tokens} tokens)" in out
    assert "requests to send: 3" in out and "budget.token_budget 1000: used 0" in out
    if kind == "transformers":  # the run loads the model, and the watch sees it
        r, events = watched(tmp_path, "generate", "a", "--quiet")
        assert r.returncode == 0, r.stderr
        assert ["module", "transformers.models.llama.modeling_llama"] in events, events


def test_dry_run_of_operator_servers_sends_gets_only_and_loads_nothing(tmp_path, server):
    """A vLLM or SGLang server an operator runs: the dry run asks it (reachable, model served)
    and loads neither the target nor its weights; an unreachable one fails, naming it."""
    fake = server(api_key=None)
    write_raw(tmp_path, 4)
    sg = {"path": "data/raw.jsonl", "format": "sharegpt"}
    data = {
        "target": {"model": SMOLLM2},
        "backends": {
            "vl": {"kind": "vllm", "url": fake.url},
            "sg": {"kind": "sglang", "url": fake.url},
        },
        "generation": {"backend": "vl", "max_new_tokens": 8, "truncated": "keep"},
        "datasets": {"v": sg, "s": {**sg, "backend": "sg"}},
    }
    setup(tmp_path, data)
    for ds in ("v", "s"):
        before = fake.requests
        r, events = watched(tmp_path, "generate", ds, "--dry-run")
        assert r.returncode == 0, r.stderr
        assert events == [] and "not checked" not in r.stdout
        assert f"backend: {fake.url} reachable; model {fake.model} served" in r.stdout
        assert "requests to send: 4" in r.stdout and "chat template renders" in r.stdout
        assert fake.requests - before == 2 and not fake.sent  # two GETs, nothing generated
    fake.stop()
    time.sleep(0.1)
    r, _ = watched(tmp_path, "generate", "v", "--dry-run")
    assert r.returncode == 2 and "unreachable" in r.stderr and fake.url in r.stderr


def test_the_dry_run_finds_the_de_quantized_builtin_where_the_run_puts_it():
    """The dry run loads the built-in target's tokenizer only once its GGUF is de-quantized,
    looking where materialize puts it."""
    from eaglet.model.target import materialize
    from eaglet.stages.responses.preflight import gguf_converted

    spec = resolve(SMOLLM2)
    materialize(spec)
    assert gguf_converted(spec)
    assert not gguf_converted(type(spec)(spec.name + "-other", "gguf", spec.location))


def test_truncated_answers_are_dropped_by_default_and_counted(tmp_path, server):
    """Answers cut at max_new_tokens (finish_reason length) are left out of the samples and
    counted, the first ids named; `truncated: keep` keeps them from the same paid answers (no
    request sent again), under another key."""
    fake = server(seed=3)
    n = 40
    write_raw(tmp_path, n)
    data = api_params(fake.url, {"qa": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["generation"].pop("truncated")  # the default
    params = setup(tmp_path, data)
    eaglet(tmp_path, "generate", "qa", "--quiet")
    prompts = list(read_jsonl(Keys(params).path("prompts", "qa")))
    cut = [
        p["id"] for p in prompts if openai_answer(p["messages"], CAP)["finish_reason"] == "length"
    ]
    assert 0 < len(cut) < n  # the oracle: the fake model's own answers
    kept = records(params, "qa")
    assert [r["id"] for r in kept] == [p["id"] for p in prompts if p["id"] not in cut]
    assert all(r["finish_reason"] == "stop" for r in kept)
    side = json.loads(Keys(params).sidecar("responses", "qa").read_text())["stats"]
    assert side["truncated"] == {"dropped": len(cut), "kept": 0, "first": cut[:5]}
    assert side["responses"] == n - len(cut)
    paid = sum(len(v) for v in fake.sent.values())

    data["datasets"]["qa"]["truncated"] = "keep"
    params_keep = setup(tmp_path, data)
    r = eaglet(tmp_path, "generate", "qa", "--quiet")
    assert r.stdout.strip() == str(Keys(params_keep).path("responses", "qa"))
    assert Keys(params_keep).key("responses", "qa") != Keys(params).key("responses", "qa")
    assert sum(len(v) for v in fake.sent.values()) == paid  # the same answers, from the store
    assert [r["id"] for r in records(params_keep, "qa")] == [p["id"] for p in prompts]
    side = json.loads(Keys(params_keep).sidecar("responses", "qa").read_text())["stats"]
    assert side["truncated"] == {"dropped": 0, "kept": len(cut), "first": cut[:5]}
    rep = side["regeneration"]
    assert rep["truncated"] == {"count": len(cut), "first": cut[:5], "what": "kept"}
    assert rep["turns"]["count"] == n and rep["refused"]["count"] == 0
    line = next(x for x in eaglet(tmp_path, "status").stdout.splitlines() if "responses" in x)
    assert f"{len(cut)} truncated kept (first {cut[0]})" in line


def test_the_regeneration_report_counts_each_check_and_names_the_first_records():
    """Records with known defects, one each: the report counts them and names them."""
    from eaglet.formats.grammar import grammar
    from eaglet.stages.responses.report import report

    def rec(rid, text="fine", reasoning=None, mode=None, messages=None, calls=None):
        r = {"id": rid, "response": text, "reasoning": reasoning, "tool_calls": calls}
        r["messages"] = messages or [{"role": "user", "content": "hi"}]
        return r | ({"chat_template_kwargs": mode} if mode else {})

    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = {"role": "assistant", "content": "", "tool_calls": [call]}
    answered = {"role": "tool", "tool_call_id": "functions.f:0", "content": "ok"}
    records = [
        rec("ok"),
        rec("empty", text="  "),
        rec("calls-only", text="", calls=[call]),  # an answer that is a tool call
        rec("no-reasoning", mode={"thinking": True}),
        rec("instant", mode={"thinking": False}),  # no reasoning asked
        rec("marker", text="done</think> really"),
        rec("marker-2", reasoning="a <|tool_call_begin|> leak"),
        rec("open-call", messages=[{"role": "user", "content": "go"}, asked]),
        rec("closed-call", messages=[{"role": "user", "content": "go"}, asked, answered]),
    ]
    stats = {
        "truncated": {"dropped": 2, "kept": 0, "first": ["t1", "t2"]},
        "rejected": {"api": 1, "too_long": 0},
        "first_rejected": {"api": "r1: content policy"},
        "token_drift": {"drift": 0.01, "worst": {"id": "w1"}},
    }
    got = report(records, stats, grammar("kimi_k2"))
    assert {k: (v.get("count"), v["first"]) for k, v in got.items()} == {
        "turns": (9, []),
        "truncated": (2, ["t1", "t2"]),
        "empty_answer": (1, ["empty"]),
        "empty_reasoning": (1, ["no-reasoning"]),
        "leftover_markers": (2, ["marker", "marker-2"]),
        "calls_unanswered": (1, ["open-call"]),
        "refused": (1, ["r1"]),
        "token_drift": (None, ["w1"]),
    }
