import json
import shutil

from eaglet.graph.keys import Keys, sidecar_of
from eaglet.params import load

from ..conftest import ROOT, tiny_params, write_params


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


# ------------------------------------------------------------------ the promise, on the demo


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
