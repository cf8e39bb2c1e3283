"""`eaglet status` tells the truth: an interrupted generation, a hidden-states build part-way,
a training run at a checkpoint and a damaged hidden folder each read as such, with the command
that continues or rebuilds it (real files, real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from eaglet.formats.hidden_store import PartialDir, Storage
from eaglet.graph.keys import Keys
from eaglet.params import load
from eaglet.reports import status

from ..conftest import ROOT, write_params
from ..fake_llm import FakeLLM
from ..stages.responses.test_generate import KEY, KEY_ENV, api_params, setup, write_raw


def sample(i, T=5, H=8):
    g = torch.Generator().manual_seed(i)
    return {
        "id": f"s{i}",
        "input_ids": list(range(T)),
        "loss_mask": [False, False, True, True, True],
        "aux": torch.randn(T, 3, H, generator=g),
        "last": torch.randn(T, H, generator=g),
    }


def show(project) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "eaglet", "status", "--params", str(project / "params.yaml")]
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def line(out: str, name: str, stage: str) -> str:
    return next(x for x in out.splitlines() if x.split()[:2] == [name, stage])


def test_an_interrupted_generation_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    fake = FakeLLM(api_key=KEY, latency=0.2).start()
    try:
        write_raw(tmp_path, 80)
        data = api_params(fake.url, {"a": {"path": "data/raw.jsonl", "format": "sharegpt"}})
        data["backends"]["api"]["concurrency"] = 4
        params = setup(tmp_path, data)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        cmd = [sys.executable, "-m", "eaglet", "generate", "a", "--quiet", "--params"]
        proc = subprocess.Popen([*cmd, str(tmp_path / "params.yaml")], cwd=tmp_path, env=env)
        deadline = time.monotonic() + 60
        while len(fake.sent) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)  # a heartbeat with its progress
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        fake.stop()
    row = line(show(tmp_path), "a", "responses")
    assert "missing" in row and "interrupted at" in row and "continue: eaglet generate a" in row
    assert status.collect(params)[1]["generation"]["run"]["state"] == "interrupted"


def _project(tmp_path):
    data = {
        "target": {"model": "smollm2-135m-instruct"},
        "datasets": {"sg": {"path": "data/demo/sharegpt.jsonl", "format": "sharegpt"}},
    }
    (tmp_path / "data" / "demo").mkdir(parents=True)
    src = ROOT / "data" / "demo" / "sharegpt.jsonl"
    (tmp_path / "data" / "demo" / "sharegpt.jsonl").write_bytes(src.read_bytes())
    params = load(write_params(tmp_path, data))
    return params, Keys(params).path("hidden", "sg")


def test_a_hidden_build_part_way_and_a_damaged_one(tmp_path):
    _, final = _project(tmp_path)
    st = Storage("bfloat16", "zstd")
    build = PartialDir(final, "plan-1")
    for i in range(3):
        build.write_shard(i, [sample(i)], st)
    os.utime(build.journal, (time.time() - 600, time.time() - 600))  # nobody writes it now
    row = line(show(tmp_path), "sg", "hidden")
    assert "partial" in row and "3 shards built; interrupted; continue: eaglet hidden sg" in row
    assert "log:" not in row  # run by hand: no log of the graph's
    log = tmp_path / "logs" / "hidden" / "sg" / f"{final.name}.log"  # Snakemake's `log:`
    log.parent.mkdir(parents=True)
    log.write_text("hidden sg: 3/8 (38%)\n")
    row = line(show(tmp_path), "sg", "hidden")
    assert f"continue: eaglet hidden sg; log: logs/hidden/sg/{final.name}.log" in row

    entries = [json.loads(x) for x in build.journal.read_text().splitlines()[1:]]
    build.finish({"format": "test", "shards": entries})
    assert "up to date" in line(show(tmp_path), "sg", "hidden")
    shard = final / entries[1]["name"]
    shard.write_bytes(shard.read_bytes()[:-20])  # cut short, e.g. a full disk on a copy
    row = line(show(tmp_path), "sg", "hidden")
    assert "damaged" in row and f"{entries[1]['name']}: " in row and "rebuild: rm -r" in row
    assert "eaglet hidden sg" in row
