"""`eaglet status` and `eaglet import-responses`: foreign raw_responses.jsonl in both schemas."""

from __future__ import annotations

import json
import os
import time

import pytest

from eaglet import locks
from eaglet.formats.io import read_jsonl, write_json
from eaglet.graph.keys import Keys, build, lock_of
from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
from eaglet.params import load
from eaglet.reports import status

from ..conftest import tiny_params, write_params
from ..fake_llm import FakeLLM
from ..stages.responses.test_generate import KEY, api_params, eaglet, setup, write_raw


def _prompts(params, ds: str) -> list[dict]:
    return list(read_jsonl(Keys(params).path("prompts", ds)))


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _generation(params, ds: str) -> dict:
    rows = status.collect(params)
    return next(r for r in rows if r["dataset"] == ds and r["stage"] == "responses")


def test_status_reports_a_foreign_raw_responses_file_in_either_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    fake = FakeLLM(api_key=KEY).start()
    write_raw(tmp_path, 12)
    sg = {"path": "data/raw.jsonl", "format": "sharegpt"}
    data = api_params(fake.url, {"oa": sg, "sgl": {**sg, "backend": "sg", "token_budget": 400}})
    data["backends"]["sg"] = {"kind": "sglang", "url": fake.url}
    params = setup(tmp_path, data)
    oa, sgl = _prompts(params, "oa"), _prompts(params, "sgl")

    # OpenAI style: the conversation ends with the answer, usage carries tokens (the answer and
    # its end of turn, as the server counted them) and cost; the last line has no usage at all
    # (counted with the target tokenizer)
    tok = load_tokenizer(resolve(SMOLLM2))
    counts = [len(tok(f"answer number {i}")["input_ids"]) + 1 for i in range(7)]
    rows = []
    for i, p in enumerate(oa[:7]):
        row = {
            "id": f"row-{i}",
            "messages": [*p["messages"], {"role": "assistant", "content": f"answer number {i}"}],
            "finish_reason": "stop",
        }
        if i < 6:
            row["usage"] = {"prompt_tokens": 30, "completion_tokens": counts[i], "cost": 0.001 * i}
        rows.append(row)
    _write(tmp_path / "raw_openai.jsonl", rows)
    tokens_oa = sum(counts[:6]) + len(tok("answer number 6")["input_ids"])

    # SGLang style: ShareGPT conversations, text + output_ids + meta_info
    rows = []
    for i, p in enumerate(sgl[:5]):
        ids = list(range(100, 100 + 20 * (i + 1)))
        human = [{"from": "human", "value": m["content"]} for m in p["messages"]]
        rows.append(
            {
                "conversations": human,
                "text": f"sglang {i}",
                "output_ids": ids,
                "meta_info": {"prompt_tokens": 40, "finish_reason": {"type": "length"}},
            }
        )
    _write(tmp_path / "raw_sglang.jsonl", rows)
    tokens_sg = sum(20 * (i + 1) for i in range(5))

    r = eaglet(tmp_path, "import-responses", "oa", "raw_openai.jsonl")
    assert "7 records (7 openai), 7 new in the store, 7 are prompts of oa" in r.stdout
    assert "oa: generated tokens drift 0.00% from the file's counts over 6 answers" in r.stdout
    r = eaglet(tmp_path, "import-responses", "sgl", "raw_sglang.jsonl")
    assert "5 records (5 sglang), 5 new" in r.stdout and f"{tokens_sg} completion" in r.stdout

    g = _generation(params, "oa")["generation"]
    assert (g["prompts"], g["done"], g["failed"], g["tokens"]) == (12, 7, 0, tokens_oa)
    assert abs(g["cost"] - 0.015) < 1e-12
    assert g["target"] == {"by": "samples", "of": 12, "have": 7, "pct": 58.3}
    g = _generation(params, "sgl")["generation"]
    assert (g["done"], g["tokens"]) == (5, tokens_sg) and g["target"]["by"] == "token_budget"
    assert g["target"]["pct"] == round(100 * tokens_sg / 400, 1)
    r = eaglet(tmp_path, "status")
    assert f"7/12 answered, {tokens_oa:,} tok (58% of prompts)" in r.stdout
    assert json.loads(eaglet(tmp_path, "status", "--json").stdout)[1]["generation"]["done"] == 7

    # a generation then pays only for what the file lacked, and keeps the imported answers
    build("responses", params, "oa", quiet=True)
    assert len(fake.sent) == 5
    recs = list(read_jsonl(Keys(params).path("responses", "oa")))
    assert [x["response"] for x in recs[:7]] == [f"answer number {i}" for i in range(7)]
    fake.stop()


def test_import_rejects_a_bad_line_and_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    write_raw(tmp_path, 4)
    params = setup(tmp_path, api_params("http://127.0.0.1:9", {"a": {"path": "data/raw.jsonl"}}))
    p = _prompts(params, "a")[0]
    good = {"prompt": p["messages"], "response": "fine", "completion_tokens": 3}
    bad = {"prompt": p["messages"], "response": "x", "output_ids": ["not", "ids"]}
    _write(tmp_path / "raw.jsonl", [good, bad])
    r = eaglet(tmp_path, "import-responses", "a", "raw.jsonl", check=False)
    assert r.returncode == 2
    assert "raw.jsonl:2: output_ids: expected a list of integers" in r.stderr
    assert _generation(params, "a")["generation"]["done"] == 0


def test_artifact_states_missing_up_to_date_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    fake = FakeLLM(api_key=KEY).start()
    write_raw(tmp_path, 5)
    data = api_params(fake.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    write_params(tmp_path, data)
    params = load(tmp_path / "params.yaml")
    assert [r["state"] for r in status.collect(params) if r["stage"] != "hidden"] == [
        "missing",
        "missing",
    ]
    params = setup(tmp_path, data)
    build("responses", params, "a", quiet=True)
    assert [r["state"] for r in status.collect(params) if r["stage"] != "hidden"] == [
        "up to date",
        "up to date",
    ]
    data["generation"]["max_new_tokens"] = 8  # older params built the responses
    write_params(tmp_path, data)
    assert [
        r["state"] for r in status.collect(load(tmp_path / "params.yaml")) if r["stage"] != "hidden"
    ] == [
        "up to date",
        "stale",
    ]
    fake.stop()


def test_a_stale_artifact_says_why(tmp_path, monkeypatch):
    """The newest artifact of another key, read from its sidecar against the current inputs:
    a changed setting, a moved upstream key, an older code version, or nothing recorded."""
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    fake = FakeLLM(api_key=KEY).start()
    raw = write_raw(tmp_path, 5)
    data = api_params(fake.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    params = setup(tmp_path, data)
    build("responses", params, "a", quiet=True)
    fake.stop()
    keys = Keys(params)
    old = {s: keys.key(s, "a") for s in ("prompts", "responses")}
    digest = keys.provenance("prompts", "a")["params"]["source_sha256"]

    def rows(data) -> dict:
        write_params(tmp_path, data)
        return {r["stage"]: r for r in status.collect(load(tmp_path / "params.yaml"))}

    data["generation"]["max_new_tokens"] = 8  # a setting the answers were made with
    r = rows(data)
    assert r["prompts"]["state"] == "up to date" and "stale" not in r["prompts"]
    assert r["responses"]["stale"] == {
        "from": old["responses"],
        "why": ["sampling.max_new_tokens: 16 -> 8"],
    }
    with open(raw, "a") as f:  # one more prompt: the prompts' key moves, and every key below
        f.write(json.dumps({"conversations": [{"from": "human", "value": "and one more?"}]}))
    r = rows(data)
    new = load(tmp_path / "params.yaml")
    now = Keys(new).provenance("prompts", "a")["params"]["source_sha256"]
    assert r["prompts"]["stale"] == {
        "from": old["prompts"],
        "why": [f"source_sha256: {digest} -> {now}"],
    }
    assert r["responses"]["stale"]["why"] == [
        "sampling.max_new_tokens: 16 -> 8",
        "upstream prompts moved",
    ]
    assert status._summary(r["prompts"]) == (
        f"since {old['prompts']}: source_sha256: {digest[:12]} -> {now[:12]}"  # keys' length
    )
    out = eaglet(tmp_path, "status").stdout
    line = next(x for x in out.splitlines() if x.split()[:2] == ["a", "responses"])
    assert f"stale       since {old['responses']}: sampling.max_new_tokens: 16 -> 8; " in line
    assert "upstream prompts moved" in line

    # an artifact of the current inputs but an older code version, newer than the others
    build("prompts", new, "a")
    cur = Keys(new)
    folder = cur.path("responses", "a").parent
    stale = folder / "0123456789ab.jsonl.zst"
    stale.write_bytes((folder / f"{old['responses']}.jsonl.zst").read_bytes())
    provenance = cur.provenance("responses", "a")
    version = provenance["code_version"]
    write_json(folder / "0123456789ab.json", {"provenance": {**provenance, "code_version": 1}})
    later = time.time() + 60
    os.utime(stale, (later, later))
    why = [f"code version: 1 -> {version}"]
    assert json.loads(eaglet(tmp_path, "status", "--json").stdout)[1]["stale"] == {
        "from": "0123456789ab",
        "why": why,
    }
    (folder / "0123456789ab.json").unlink()  # built by something that recorded nothing
    r = rows(data)["responses"]
    assert r["stale"] == {"from": "0123456789ab", "why": [status.NO_PROVENANCE]}
    assert status._summary(r).startswith(
        "0123456789ab was built from other inputs (no provenance to compare); 0/6 answered"
    )


def test_gc_removes_other_keys_leftovers_and_caches_but_not_the_current_ones(tmp_path, monkeypatch):
    from eaglet.graph.artifacts import gc

    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    fake = FakeLLM(api_key=KEY).start()
    write_raw(tmp_path, 5)
    data = api_params(fake.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
    params = setup(tmp_path, data)
    build("responses", params, "a", quiet=True)
    fake.stop()
    keys = Keys(params)
    hidden = keys.path("hidden", "a")
    current = hidden.parent / f".{hidden.name}.partial"
    old = hidden.parent / ".0123456789ab.partial"
    tmp = keys.path("responses", "a").parent / ".0123456789ab.jsonl.zst.tmp-x1"
    cache, old_cache = (hidden.parent / f"{k}.cache" for k in (hidden.name, "0123456789ab"))
    for d in (current, old, cache / ".rank-0.partial", old_cache / ".rank-0.partial"):
        (d / "journal").mkdir(parents=True)
    tmp.write_bytes(b"half")
    inside = current / "journal" / ".shard-0.tmp-x2"  # a write the resumed folder's build left
    inside.write_bytes(b"half")
    planned = {a.path: a.state for a in gc(keys, dry_run=True)}
    assert planned == {
        old: "unfinished",
        tmp: "unfinished",
        old_cache: "cache",
        inside: "unfinished",
    }
    with locks.hold(lock_of(hidden), "eaglet hidden a"):  # its build runs: nothing of it goes
        assert inside not in {a.path for a in gc(keys, dry_run=True)}
    gc(keys)
    assert current.is_dir() and cache.is_dir() and not inside.exists()
    assert not old.exists() and not tmp.exists() and not old_cache.exists()
    assert keys.path("responses", "a").exists()


def test_a_running_training_shows_its_step_loss_and_eta(project):
    """The beacon a training run writes in its work folder (Progress, as the stage makes it)
    is what `eaglet status` shows while Snakemake runs the stage quietly."""
    from eaglet.progress import BEACON, Progress

    params = load(write_params(project, tiny_params()))
    path = Keys(params).path("train", "d")
    work = path.parent / f".{path.name}.work"
    work.mkdir(parents=True)
    progress = Progress("train", 40, quiet=True, unit="step", beacon=work / BEACON)
    progress.done = progress.base = 10  # resumed at step 10: not in the rate
    progress.note(loss=2.3456)
    progress.update(5, tokens=5000)
    log = project / "logs" / "train" / "d" / f"{path.name}.log"  # the rule's, under Snakemake
    log.parent.mkdir(parents=True)
    log.write_text("train: 15/40 (38%)\n")
    with locks.hold(lock_of(path), "eaglet train d"):  # as graph.keys.build holds it
        row = next(r for r in status.collect(params) if r["stage"] == "train")
    assert row["state"] == "partial" and row["next"] == f"running (pid {os.getpid()})"
    assert row["log"] == os.path.relpath(log)
    beat = row["partial"]["progress"]
    assert (beat["done"], beat["total"], beat["unit"], beat["loss"]) == (15, 40, "step", 2.3456)
    assert beat["eta_s"] == pytest.approx(25 / beat["rate"])  # 5 steps done here, 25 to go
    line = status._summary(row)
    assert line.startswith("15/40 step, ") and "ETA " in line and "loss 2.346" in line
    assert line.endswith(f"; running (pid {os.getpid()}); log: {os.path.relpath(log)}")
    progress.close()  # the beacon goes with the run
    assert not (work / BEACON).exists()
