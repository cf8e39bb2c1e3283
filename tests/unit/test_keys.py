import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from eaglet.graph.keys import STAGES, Keys, sidecar_of
from eaglet.params import load

from ..conftest import ROOT, bump_version, tiny_params, write_params


def test_keys_follow_params_slices(project):
    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    p_sg, r_sg = keys.key("prompts", "sg"), keys.key("responses", "sg")
    r_dolly = keys.key("responses", "dolly")
    assert len(p_sg) == 12 and int(p_sg, 16) >= 0
    assert (
        keys.path("responses", "sg") == project / "data" / "responses" / "sg" / f"{r_sg}.jsonl.zst"
    )
    assert sidecar_of(keys.path("responses", "sg")) == keys.sidecar("responses", "sg")

    data["datasets"]["sg"]["temperature"] = 0.7  # a generation param of one dataset
    k2 = Keys(load(write_params(project, data)))
    assert k2.key("prompts", "sg") == p_sg
    assert k2.key("responses", "sg") != r_sg
    assert k2.key("responses", "dolly") == r_dolly

    data["datasets"]["sg"].pop("temperature")  # set back: the old key again
    data["backends"]["local"]["batch_size"] = 3  # speed settings are not in the key
    assert Keys(load(write_params(project, data))).key("responses", "sg") == r_sg

    data["datasets"]["sg"]["max_samples"] = 5  # a prompts param moves prompts and downstream
    k3 = Keys(load(write_params(project, data)))
    assert k3.key("prompts", "sg") != p_sg and k3.key("responses", "sg") != r_sg


def test_raw_content_not_path_or_mtime_makes_the_key(project):
    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    before = keys.key("prompts", "sg")
    raw = project / "data" / "demo" / "sharegpt.jsonl"
    shutil.copy(raw, project / "copy.jsonl")
    data["datasets"]["sg"]["path"] = "copy.jsonl"
    assert Keys(load(write_params(project, data))).key("prompts", "sg") == before
    (project / "copy.jsonl").write_text(raw.read_text() + "\n")  # blank line: different bytes
    assert Keys(load(write_params(project, data))).key("prompts", "sg") != before


def test_suite_file_keys_evaluate_by_its_bytes_not_its_path(project):
    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    split_eval, train_key = keys.key("evaluate", "d"), keys.key("train", "d")
    heldout = ROOT / "data" / "heldout" / "natural.jsonl"
    shutil.copy(heldout, project / "a.jsonl")
    data["drafters"]["d"]["evaluate"]["suites"] = {"natural": {"path": "a.jsonl"}}
    keys = Keys(load(write_params(project, data)))
    from_file = keys.key("evaluate", "d")
    assert from_file != split_eval and keys.key("train", "d") == train_key
    assert "a.jsonl" not in json.dumps(keys.provenance("evaluate", "d"))
    shutil.copy(heldout, project / "b.jsonl")  # moved: the same bytes
    data["drafters"]["d"]["evaluate"]["suites"] = {"natural": {"path": "b.jsonl"}}
    assert Keys(load(write_params(project, data))).key("evaluate", "d") == from_file
    (project / "b.jsonl").write_text(heldout.read_text() + "\n")
    assert Keys(load(write_params(project, data))).key("evaluate", "d") != from_file


def test_keys_match_across_processes(project):
    path = write_params(project, tiny_params())
    code = (
        "from eaglet.graph.keys import Keys; from eaglet.params import load\n"
        f"print(Keys(load({str(path)!r})).key('responses', 'sg'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == Keys(load(path)).key("responses", "sg")


# ------------------------------------------------------------------ the promise, on the demo

# What each stage feeds (drafter stages read every dataset's hidden states).
DOWNSTREAM = {
    "prompts": {"responses"},
    "responses": {"hidden"},
    "hidden": {"vocab", "train", "evaluate"},
    "vocab": {"train"},
    "train": {"evaluate", "sglang", "vllm"},
    "evaluate": set(),
    "sglang": set(),
    "vllm": {"evaluate"},  # the engine measures acceptance with the vLLM export
}


def _and_downstream(*stages: str) -> set[str]:
    out, todo = set(), list(stages)
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(DOWNSTREAM[s])
    return out


def _demo_keys(pkg_root: Path, cache: Path) -> dict[tuple[str, str], str]:
    """`eaglet keys --json` on the demo's params.yaml, with the eaglet package at `pkg_root`."""
    out = subprocess.run(
        [sys.executable, "-m", "eaglet", "keys", "--json", "--params", str(ROOT / "params.yaml")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(pkg_root), "EAGLET_CACHE": str(cache)},
    )
    return {(r["stage"], r["name"]): r["key"] for r in json.loads(out.stdout)}


def _bump(module: str) -> tuple[str, str, str]:
    """(file, its source, the source with the stage's version one higher)."""
    text = (ROOT / "src" / "eaglet" / "stages" / f"{module}.py").read_text()
    return (f"stages/{module}.py", text, bump_version(text))


# (file, old text or "" to append, new text, stages whose keys must move): plumbing and kernel
# edits move none (the guard of tests/unit/test_code_versions.py catches a kernel edited without a
# bump); a stage's version bump moves that stage and its downstream, nothing else.
EDITS = [
    ("__init__.py", '__version__ = "0.1.0"', '__version__ = "9.9.9"', set()),
    ("stages/preflight.py", "requests to send", "requests that would go out", set()),
    ("progress.py", 'f"ETA {', 'f"eta {', set()),
    ("reports/status.py", '"stale"', '"out of date"', set()),
    ("cli.py", "every artifact's current key", "the current key of every artifact", set()),
    ("graph/keys.py", "KEY_LEN = 12", "KEY_LEN: int = 12", set()),
    ("engines/http.py", "POOL_CONNECTIONS = 16", "POOL_CONNECTIONS = 32", set()),
    ("model/drafter.py", "", "\nLAYER_NOTE = 1\n", set()),
    (*_bump("prompts"), _and_downstream("prompts")),
    (*_bump("generate"), _and_downstream("responses")),
    (*_bump("hidden"), _and_downstream("hidden")),
    (*_bump("vocab"), _and_downstream("vocab")),
    (*_bump("train"), _and_downstream("train")),
    (*_bump("evaluate"), {"evaluate"}),
    (*_bump("export"), {"sglang", "vllm", "evaluate"}),
]


def test_plumbing_edits_move_no_key_and_version_bumps_move_their_stage_and_downstream(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(ROOT / "src" / "eaglet", tmp_path / "base" / "eaglet")
    base = _demo_keys(tmp_path / "base", cache)
    assert {stage for stage, _ in base} == set(STAGES)  # every stage of the demo keyed
    for i, (rel, old, new, expected) in enumerate(EDITS):
        pkg = tmp_path / f"edit{i}"
        shutil.copytree(tmp_path / "base", pkg)
        path = pkg / "eaglet" / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1) if old else text + new)
        keys = _demo_keys(pkg, cache)
        moved = {stage for (stage, name), key in keys.items() if base[stage, name] != key}
        assert moved == expected, rel
        for (stage, name), key in keys.items():  # a moved stage moves for every name
            assert (key != base[stage, name]) == (stage in expected), (rel, stage, name)


def _local_settings(data: dict, device: str, dtype: str) -> dict:
    data["backends"]["local"].update(device=device, dtype=dtype)
    data["hidden"] = {"device": device, "compute_dtype": dtype}
    data["drafters"]["d"]["train"].update(device=device.split(":")[0], dtype=dtype)
    data["drafters"]["d"]["evaluate"]["device"] = device
    return data


def test_auto_device_and_dtype_key_like_what_they_resolve_to(project, monkeypatch):
    def keys(device: str, dtype: str) -> dict[str, str]:
        k = Keys(load(write_params(project, _local_settings(tiny_params(), device, dtype))))
        stages = ("responses", "hidden", "train", "evaluate")
        return {s: k.key(s, "sg" if s in ("responses", "hidden") else "d") for s in stages}

    monkeypatch.setattr("eaglet.device.NVIDIA_DRIVER", project / "no-driver")
    cpu = keys("auto", "auto")
    assert cpu == keys("cpu", "float32")  # auto is what it resolves to on this machine
    assert all(cpu[s] != v for s, v in keys("cpu", "bfloat16").items())  # another dtype
    driver = project / "nvidia-version"
    driver.write_text("NVRM version: 550\n")
    monkeypatch.setattr("eaglet.device.NVIDIA_DRIVER", driver)
    gpu = keys("auto", "auto")  # the same params on a GPU machine: cuda, bfloat16
    assert gpu == keys("cuda", "bfloat16") and all(gpu[s] != cpu[s] for s in cpu)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden: the CPU build again
    assert keys("auto", "auto") == cpu


def test_numbers_are_canonical_in_keys(tmp_path):
    """`max_samples: 8.0` and `8`, `temperature: 0.0` and `0`: one value, one key."""
    from eaglet.graph.keys import Keys
    from eaglet.params import load

    from ..conftest import tiny_params, write_params

    def keys(**overrides):
        data = tiny_params(**overrides)
        (tmp_path / "data" / "demo").mkdir(parents=True, exist_ok=True)
        for name in ("sharegpt.jsonl", "dolly.jsonl"):
            src = ROOT / "data" / "demo" / name
            (tmp_path / "data" / "demo" / name).write_bytes(src.read_bytes())
        return Keys(load(write_params(tmp_path, data)))

    a, b = keys(temperature=0.0, max_new_tokens=8), keys(temperature=0, max_new_tokens=8.0)
    for stage in ("prompts", "responses", "hidden"):
        assert a.key(stage, "sg") == b.key(stage, "sg"), stage
    assert a.spec("responses", "sg").values.sampling["temperature"] == 0
    c = keys(temperature=0.5)
    assert c.key("responses", "sg") != a.key("responses", "sg")
