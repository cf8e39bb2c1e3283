"""Nothing paid for is lost: generation under faults, against real loopback servers.

Each case states what was paid (answers the server sent), what was kept (answers in the store)
and what the user was told: paid = stored + reported lost, no hang, one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from eaglet.errors import EagletError
from eaglet.formats.store import Store, store_path
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.params import load

from ..conftest import ROOT, write_params
from ..fake_llm import FakeLLM
from ..stages.responses.test_generate import KEY, KEY_ENV, api_params, records, setup, write_raw


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
def fake():
    servers = []

    def start(**kw) -> FakeLLM:
        servers.append(FakeLLM(api_key=KEY, **kw).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def paid(server: FakeLLM) -> int:
    return sum(len(v) for v in server.sent.values())


def stored(params) -> int:
    store = Store(store_path(params.root))
    try:
        return store.db.execute("SELECT COUNT(*) FROM responses WHERE status = 'ok'").fetchone()[0]
    finally:
        store.close()


def eaglet_proc(project, *args) -> subprocess.Popen:
    """eaglet as a terminal starts it: SIGINT at its default even when this test runs in a
    background job, whose children inherit SIGINT ignored (and rightly keep ignoring it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "eaglet", *args, "--params", str(project / "params.yaml")]
    return subprocess.Popen(
        cmd,
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("budget", [None, 10_000])
def test_a_store_that_cannot_write_stops_the_run_and_reports_what_it_lost(
    tmp_path, fake, monkeypatch, budget
):
    """The store fails its 6th write (SQLite: database or disk is full): the run stops at once
    with one line naming the store, every answer committed before is kept, the ones that
    arrived after are reported lost; with a token budget set it does not hang."""
    server = fake(latency=0.01)
    write_raw(tmp_path, 60)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt", "token_budget": budget}
    data = api_params(server.url, {"a": {k: v for k, v in ds.items() if v is not None}})
    data["backends"]["api"]["concurrency"] = 4
    params = setup(tmp_path, data)
    real_put, puts = Store.put, [0]

    def put(self, key, backend, result):
        puts[0] += 1
        if puts[0] > 5:
            raise sqlite3.OperationalError("database or disk is full")
        real_put(self, key, backend, result)

    monkeypatch.setattr(Store, "put", put)
    t0 = time.monotonic()
    with pytest.raises(EagletError) as e:
        build("responses", params, "a", quiet=True)
    assert time.monotonic() - t0 < 30  # no hang
    msg = str(e.value)
    assert "\n" not in msg and "responses.sqlite: cannot store answers" in msg
    lost = int(re.search(r"(\d+) answers paid and not stored", msg).group(1))
    monkeypatch.setattr(Store, "put", real_put)
    kept = stored(params)
    assert 0 < kept <= 5 and lost > 0
    assert paid(server) == kept + lost  # every paid answer is stored or reported
    assert paid(server) < 60  # it stopped sending
    assert not Keys(params).path("responses", "a").exists()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_200_of_an_unexpected_shape_is_a_retried_failure(tmp_path, fake, concurrency):
    """A chat `message` that is a string, SGLang's `meta_info: null`: counted, retried, never a
    dead worker; every prompt ends answered, nothing lost."""
    server = fake(faults={"badshape": 0.4}, max_faults=2, seed=1)
    write_raw(tmp_path, 20)
    data = api_params(server.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"]["api"] |= {"concurrency": concurrency, "backoff_s": 0.001}
    data["backends"]["sg"] = {"kind": "sglang", "url": server.url, "backoff_s": 0.001}
    data["backends"]["sg"]["concurrency"] = concurrency
    data["datasets"]["s"] = {"path": "data/raw.jsonl", "format": "sharegpt", "backend": "sg"}
    params = setup(tmp_path, data)
    for ds in ("a", "s"):
        build("responses", params, ds, quiet=True)
        assert len(records(params, ds)) == 20
    assert server.faulted["badshape"] > 0
    assert paid(server) == 40 == stored(params)
    bad = [r for ds in "as" for r in records(params, ds) if r["attempts"] > 1]
    assert len(bad) >= server.faulted["badshape"] // 2


def test_one_generation_per_dataset_at_a_time(tmp_path, fake):
    """A second `eaglet generate` of the same dataset is refused naming the first; nothing is
    paid twice."""
    server = fake(latency=0.3)
    write_raw(tmp_path, 12)
    data = api_params(server.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"]["api"]["concurrency"] = 2
    params = setup(tmp_path, data)
    first = eaglet_proc(tmp_path, "generate", "a", "--quiet")
    try:
        deadline = time.monotonic() + 30
        while not server.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(
            EagletError, match=rf"another eaglet generate is running \(pid {first.pid}"
        ):
            build("responses", params, "a", quiet=True)
        assert first.wait(timeout=60) == 0, first.stderr.read()
    finally:
        first.kill()
    assert paid(server) == 12
    build("responses", params, "a", quiet=True)  # the lock went with its holder
    assert paid(server) == 12


def test_ctrl_c_stops_sending_keeps_what_arrived_and_exits_130(tmp_path, fake):
    server = fake(latency=1.0)
    write_raw(tmp_path, 200)
    data = api_params(server.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    data["backends"]["api"] |= {"concurrency": 8, "timeout_s": 600, "max_retries": 8}
    setup(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    proc = eaglet_proc(tmp_path, "generate", "a", "--quiet")
    started = time.monotonic()
    deadline = started + 60
    while paid(server) < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    at_signal = f"signal after {time.monotonic() - started:.1f} s, {paid(server)} answers paid"
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5, f"{at_signal}: {err}"
    requests = server.requests
    time.sleep(1.5)
    assert server.requests == requests  # nothing sent after the exit
    kept = stored(params)
    m = re.search(r"interrupted; (\d+) answers kept in the store, (\d+) requests in flight", err)
    assert m and int(m.group(1)) == kept and paid(server) <= kept + int(m.group(2))
    # every answer the server sent by the interrupt is kept or reported in flight (the last
    # ones may still be on the wire when the signal lands)
    assert kept + int(m.group(2)) >= 16 and kept > 0 and paid(server) < 200


def test_prompts_that_cannot_fit_max_length_are_never_sent(tmp_path, fake):
    """A prompt that leaves no room for an answer in the dataset's max_length is not paid for:
    recorded too long, left out and counted; a larger max_length sends it."""
    server = fake()
    path = tmp_path / "data" / "raw.jsonl"
    path.parent.mkdir(parents=True)
    rows = [
        {"conversations": [{"from": "human", "value": f"Short question {i}?"}]} for i in range(4)
    ]
    long = " ".join(["words"] * 120)
    rows += [{"conversations": [{"from": "human", "value": f"{long} {i}"}]} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = {"path": "data/raw.jsonl", "format": "sharegpt", "max_length": 64}
    params = setup(tmp_path, api_params(server.url, {"a": ds}))
    out = build("responses", params, "a", quiet=True)
    assert len(records(params, "a")) == 4 and paid(server) == 4
    assert all("words" not in json.dumps(b) for b in server.sent.values())
    stats = json.loads(sidecar_of(out).read_text())["stats"]
    assert stats["rejected"] == {"api": 0, "too_long": 2}
    assert "does not fit max_length 64" in stats["first_rejected"]["too_long"]
    data = json.loads(json.dumps(api_params(server.url, {"a": ds | {"max_length": 512}})))
    write_params(tmp_path, data)
    build("responses", load(tmp_path / "params.yaml"), "a", quiet=True)
    assert paid(server) == 6


def test_a_damaged_store_row_and_an_unwritable_data_folder_are_one_line(tmp_path, fake):
    server = fake()
    write_raw(tmp_path, 4)
    data = api_params(server.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    params = setup(tmp_path, data)
    build("responses", params, "a", quiet=True)
    db = sqlite3.connect(store_path(params.root))
    key = db.execute("SELECT key FROM responses LIMIT 1").fetchone()[0]
    db.execute('UPDATE responses SET result = \'{"response": "cut\' WHERE key = ?', (key,))
    db.commit()
    db.close()
    proc = eaglet_proc(tmp_path, "generate", "a", "--quiet", "--out", str(tmp_path / "o.zst"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"responses.sqlite: the answer under key {key[:16]} is unreadable" in err
    # data/responses is a file, not a folder: the write fails with one line naming it
    (tmp_path / "data" / "responses").mkdir(exist_ok=True)
    blocked = tmp_path / "data" / "responses" / "a"
    if blocked.exists():
        import shutil

        shutil.rmtree(blocked)
    blocked.write_text("not a folder")
    db = sqlite3.connect(store_path(params.root))
    db.execute("DELETE FROM responses WHERE key = ?", (key,))
    db.commit()
    db.close()
    before = paid(server)
    proc = eaglet_proc(tmp_path, "generate", "a", "--quiet")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("eaglet: error: ") and last.endswith("data/responses/a: File exists")
    # the build's lock goes beside the output first: a folder that cannot be written stops the
    # run before any request, so nothing is paid for an answer it could not keep
    assert paid(server) == before and stored(params) == 3


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KiB tmpfs for the store (data/cache): a filesystem that fills up mid-run."""
    where = tmp_path / "data" / "cache"
    where.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(where)])
    if r.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI and the developers' machines have it)")
    yield where
    subprocess.run(["umount", "-l", str(where)])


@pytest.mark.parametrize("budget", [None, 100_000])
def test_a_full_filesystem_under_the_store_stops_the_run(tmp_path, fake, small_disk, budget):
    """The store's filesystem fills up: one line, the answers committed before are kept, the
    rest reported lost (paid = stored + lost), no hang with a token budget set."""
    server = fake(latency=0.002)
    write_raw(tmp_path, 1500)
    ds = {"path": "data/raw.jsonl", "format": "sharegpt"} | (
        {"token_budget": budget} if budget else {}
    )
    data = api_params(server.url, {"a": ds})
    data["backends"]["api"]["concurrency"] = 8
    params = setup(tmp_path, data)
    proc = eaglet_proc(tmp_path, "generate", "a", "--quiet")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "responses.sqlite: cannot store answers" in last and "full" in last, last
    lost = int(re.search(r"(\d+) answers paid and not stored", last).group(1))
    kept = stored(params)
    assert kept > 0 and paid(server) == kept + lost and paid(server) < 1500
