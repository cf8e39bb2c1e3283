"""hidden.mode online and hybrid: training takes its states from a real vLLM engine.

The reference is offline training on shards the in-process transformers forward wrote (fp32):
the states agree to the engine's noise and the drafters trained on them agree with it."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglet.formats.io import read_json
from eaglet.graph.keys import Keys, build
from eaglet.params import load
from eaglet.reports import status
from eaglet.stages.hidden import read as hidden_read

from ...cli import command, eaglet, environ
from ...conftest import DEMO, tiny_params

pytestmark = [pytest.mark.engine, pytest.mark.slow]
EXACT = {"dtype": "float32", "compute_dtype": "float32", "threads": 2, "concurrency": 4}


def write(root: Path, name: str, mode: str, **train) -> Path:
    data = tiny_params()
    data["target"]["max_length"] = 256
    data["hidden"] = {"backend": "transformers", **EXACT}
    if mode != "offline":
        data["hidden"] |= {"backend": "vllm", "mode": mode, "spool": str(root / f"spool-{name}")}
    data["drafters"]["d"]["train"] |= {"checkpoint_every": 1, **train}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def engines_of(spool: Path) -> list[str]:
    """Processes whose command line names this spool: the engine this run started."""
    r = subprocess.run(["pgrep", "-f", str(spool)], capture_output=True, text=True)
    return r.stdout.split()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A project with responses of the embedded target, and the offline reference drafter."""
    import shutil

    root = tmp_path_factory.mktemp("online")
    shutil.copytree(DEMO, root / "data" / "demo")
    ref = load(write(root, "offline", "offline"))
    for ds in ("sg", "dolly"):
        build("prompts", ref, ds)
        build("responses", ref, ds, quiet=True)
        build("hidden", ref, ds, quiet=True)
    build("vocab", ref, "d")
    eaglet("train", "d", params=root / "offline.yaml", env=environ(OMP_NUM_THREADS="1"), check=True)
    return root


def test_online_kill_resume_matches_offline(root, capsys):
    params_path = write(root, "online", "online")
    params, spool = load(params_path), root / "spool-online"
    keys = Keys(params)
    for ds in ("sg", "dolly"):  # the stage writes the manifest and token ids: no engine, no shards
        eaglet("hidden", ds, params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
        assert sorted(p.name for p in keys.path("hidden", ds).iterdir()) == [
            "manifest.json",
            "tokens.safetensors",
        ]
    status.show(params)  # `eaglet status` reads a folder without shards
    assert capsys.readouterr().out.count("ids only: states from the engine") == 2
    eaglet("vocab", "d", params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    want = load_file(Keys(load(root / "offline.yaml")).path("vocab", "d"))
    got = load_file(keys.path("vocab", "d"))
    assert all(torch.equal(got[k], want[k]) for k in want)

    # the online states equal the offline shards' (transformers fp32) to the engine's noise
    ref = hidden_read.open_readers(hidden_read.states(load(root / "offline.yaml"), "d"))
    got = hidden_read.open_readers(hidden_read.states(params, "d"))
    try:
        for r, g in zip(ref, got, strict=True):
            for sid in r.ids[:3]:
                a, b = r.get(sid), g.get(sid)
                assert torch.equal(a["input_ids"], b["input_ids"])
                for f in ("aux", "last"):
                    err = (a[f] - b[f]).norm(dim=-1) / a[f].norm(dim=-1)
                    assert err.max() < 1e-4, (sid, f, float(err.max()))
    finally:
        hidden_read.close_readers(got)
    assert not engines_of(spool)

    # kill -9 mid-training: the reaper ends the engine; the rerun resumes from the checkpoint
    out = keys.path("train", "d")
    cmd = command("train", "d", params=params_path)
    env = environ(OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, cwd=root, stderr=subprocess.DEVNULL)
    ckpt = out.parent / f".{out.name}.work" / "checkpoint.pt"
    deadline = time.monotonic() + 400
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before a checkpoint could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while engines_of(spool) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engines_of(spool), "engine outlived a training process killed with SIGKILL"
    assert not out.exists()

    eaglet("train", "d", params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    stats = read_json(keys.sidecar("train", "d"))["stats"]
    assert stats["resumed_from"] > 0 and stats["steps"] > stats["resumed_from"]
    assert not engines_of(spool) and not list(spool.iterdir())
    for ds in ("sg", "dolly"):  # no states on disk in online mode
        hid = keys.path("hidden", ds)
        assert not list(hid.parent.glob(f"*{hid.name}*/**/*shard*"))

    offline = Keys(load(root / "offline.yaml"))
    want = read_json(offline.sidecar("train", "d"))["stats"]
    assert stats["heldout"]["acc"] == pytest.approx(want["heldout"]["acc"], abs=0.05)
    assert stats["heldout"]["loss"] == pytest.approx(want["heldout"]["loss"], rel=0.02)
    a, b = (
        load_file(offline.path("train", "d") / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    drift = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(
        json.dumps({"weight_drift": drift, "online": stats["heldout"], "offline": want["heldout"]})
    )
    assert drift < 5e-3


def test_hybrid_caches_then_trains_without_engine(root):
    params_path = write(root, "hybrid", "hybrid", epochs=2)
    params = load(params_path)
    keys = Keys(params)
    for ds in ("sg", "dolly"):
        eaglet("hidden", ds, params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    eaglet("vocab", "d", params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    first = eaglet("train", "d", params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    assert "from the engine" in first.stderr
    for ds in ("sg", "dolly"):
        cache = keys.path("hidden", ds).with_name(keys.path("hidden", ds).name + ".cache")
        assert list(cache.glob(".rank-0.partial/shard-*.safetensors"))

    # another run (another seed: another key) reads every state from the cache, no engine
    params_path = write(root, "hybrid", "hybrid", epochs=2, seed=1)
    second = eaglet("train", "d", params=params_path, env=environ(OMP_NUM_THREADS="1"), check=True)
    assert "0 samples (0 tokens) from the engine, " in second.stderr, second.stderr[-2000:]
    assert not engines_of(root / "spool-hybrid")
