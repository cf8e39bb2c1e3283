import shutil

import pytest

from eaglet.errors import EagletError
from eaglet.params import load

from ..conftest import ROOT, tiny_params, write_params


def params_error(tmp_path, text: str) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(EagletError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


BASE = "target: {model: smollm2-135m-instruct}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            BASE + "datasets: {a: {path: a.jsonl, formt: dolly}}",
            "datasets.a: Additional properties",
        ),
        (
            BASE + "datasets: {a: {path: a.jsonl, max_samples: 0}}",
            "datasets.a.max_samples: 0 is less",
        ),
        (
            BASE + "datasets: {a: {path: a.jsonl, format: csv}}",
            "datasets.a.format: 'csv' is not one",
        ),
        (BASE + "backends: {s: {kind: sglang}}\ndatasets: {a: {path: x}}", "backends.s: 'url' is"),
        (BASE + "backends: {o: {kind: tgi}}\ndatasets: {a: {path: x}}", "backends.o.kind: 'tgi'"),
        (
            BASE + "backends: {e: {kind: vllm, dtype: fp8}}\ndatasets: {a: {path: x}}",
            "backends.e.dtype: 'fp8' is not one of",
        ),
        (
            BASE + "datasets: {a: {path: x, backend: gpu}}",
            "datasets.a.backend: unknown backend 'gpu'",
        ),
        (
            BASE + "datasets: {a: {path: x}}\ndrafters: {d: {datasets: [b]}}",
            "drafters.d.datasets.0",
        ),
        (BASE + "datasets: {}", "datasets: {} should be non-empty"),
        ("datasets: {a: {path: x}}", "(top level): 'target' is a required property"),
        ("target: [", "invalid YAML"),
        ("- 1\n- 2", "expected a mapping"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, expected):
    assert expected in params_error(tmp_path, text)


def test_missing_file(tmp_path):
    with pytest.raises(EagletError, match="no such params file"):
        load(tmp_path / "nope.yaml")


def test_defaults_and_overrides(tmp_path):
    path = write_params(
        tmp_path,
        {
            "target": {"model": "smollm2-135m-instruct"},
            "generation": {"max_new_tokens": 100},
            "datasets": {"a": {"path": "in/a.jsonl", "temperature": 0.7}},
        },
    )
    p = load(path)
    assert p.data["backends"] == {
        "local": {
            "kind": "transformers",
            "device": "auto",
            "dtype": "auto",
            "batch_size": 16,
            "threads": 0,
        }
    }
    assert p.generation("a") == {
        "backend": "local",
        "max_new_tokens": 100,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 0,
        "max_token_drift": 0.02,
        "thinking": None,
        "thinking_fraction": 0.5,
        "truncated": "drop",
        "marker_text": "skip",
        "turns": "all",
    }
    assert p.dataset("a")["format"] == "auto"
    assert p.resolve(p.dataset("a")["path"]) == tmp_path / "in" / "a.jsonl"
    with pytest.raises(EagletError, match="no dataset 'b'"):
        p.dataset("b")


def test_backend_identity_excludes_speed_settings(tmp_path):
    base = {
        "target": {"model": "smollm2-135m-instruct"},
        "backends": {
            "or": {
                "kind": "openai",
                "base_url": "http://x/v1",
                "model": "m",
                "api_key_env": "K",
                "concurrency": 8,
            }
        },
        "generation": {"backend": "or"},
        "datasets": {"a": {"path": "a"}},
    }
    a = load(write_params(tmp_path, base)).backend_identity("or")
    base["backends"]["or"]["concurrency"] = 300
    assert load(write_params(tmp_path, base)).backend_identity("or") == a
    assert a == {
        "kind": "openai",
        "base_url": "http://x/v1",
        "model": "m",
        "reasoning_field": "reasoning_content",
    }


def test_shipped_params_validate():
    for path in [
        *sorted(ROOT.glob("params*.yaml")),
        *sorted((ROOT / "examples").glob("*.params.yaml")),
    ]:
        p = load(path)
        assert p.datasets and p.drafters


def test_production_example_shape():
    p = load(ROOT / "examples" / "kimi-k2.5.params.yaml")
    assert len(p.datasets) == 8
    kinds = {p.backend(p.generation(d)["backend"])["kind"] for d in p.datasets}
    assert kinds == {"sglang", "openai"}
    assert any("token_budget" in p.dataset(d) for d in p.datasets)
    assert "api_key" not in str(p.data).replace("api_key_env", "")


# ---------------------------------------------------------------------------- overlays


def test_overlay_merges_onto_the_production_file(tmp_path):
    """`extends:` = the example with a few keys changed: mappings merge, null removes, lists
    and scalars replace; the merged document is what is validated and used."""
    example = load(ROOT / "examples" / "kimi-k2.5.params.yaml")
    overlay = tmp_path / "smoke.yaml"
    overlay.write_text(
        f"extends: {ROOT / 'examples' / 'kimi-k2.5.params.yaml'}\n"
        "target: {model: smollm2-135m-instruct, max_length: 512, revision: null,"
        " trust_remote_code: null, grammar: chatml}\n"
        "hidden: {url: null, spool: null}\n"
        "datasets: {B2_opencodeinstruct: {max_samples: 4, token_budget: null}}\n"
        "drafters: {kimi_k25_eagle3: {datasets: [B2_opencodeinstruct]}}\n"
    )
    p = load(overlay)
    assert p.path == overlay and p.root == tmp_path  # paths resolve against the overlay
    target = {"model": "smollm2-135m-instruct", "max_length": 512, "trust_remote_code": False}
    target |= {"grammar": "chatml", "thinking_switch": "thinking"}  # the example's switch, kept
    assert p.target == target  # null removed the example's revision and trust: the default
    assert "url" not in p.data["hidden"] and p.data["hidden"]["fp8"] is True  # kept
    b2 = p.dataset("B2_opencodeinstruct")
    assert (
        b2["max_samples"] == 4 and "token_budget" not in b2 and b2["format"] == "opencodeinstruct"
    )
    assert p.datasets == example.datasets  # the others untouched
    assert p.drafter("kimi_k25_eagle3")["datasets"] == ["B2_opencodeinstruct"]
    assert p.drafter("kimi_k25_eagle3")["train"] == example.drafter("kimi_k25_eagle3")["train"]
    assert p.backend("openrouter") == example.backend("openrouter")


def test_overlay_keys_are_those_of_the_merged_file(project):
    """An overlay and the flat file it amounts to put every artifact at the same key."""
    import yaml

    from eaglet.graph.keys import Keys

    from ..conftest import tiny_params

    base = tiny_params()
    write_params(project, base)
    (project / "smoke.yaml").write_text(
        "extends: params.yaml\ngeneration: {max_new_tokens: 4}\ndatasets: {sg: {max_samples: 2}}\n"
    )
    base["generation"]["max_new_tokens"] = 4
    base["datasets"]["sg"]["max_samples"] = 2
    (project / "flat.yaml").write_text(yaml.safe_dump(base))
    over, flat, orig = (load(project / f) for f in ("smoke.yaml", "flat.yaml", "params.yaml"))
    for stage, ds in (("prompts", "sg"), ("responses", "sg"), ("responses", "dolly")):
        assert Keys(over).path(stage, ds) == Keys(flat).path(stage, ds)
    assert Keys(over).key("responses", "dolly") != Keys(orig).key("responses", "dolly")
    assert Keys(over).key("prompts", "dolly") == Keys(orig).key("prompts", "dolly")


@pytest.mark.parametrize(
    ("overlay", "expected"),
    [
        ("extends: params.yaml\ndatasets: {a: {max_samples: 0}}", "datasets.a.max_samples: 0"),
        ("extends: params.yaml\ntarget: null", "'target' is a required property"),
        ("extends: nowhere.yaml\n", "nowhere.yaml: no such params file"),
        ("extends: smoke.yaml\n", "extends: a cycle"),
        ("extends: [params.yaml]\n", "extends: expected the path"),
    ],
)
def test_overlay_errors(tmp_path, overlay, expected):
    (tmp_path / "params.yaml").write_text(BASE + "datasets: {a: {path: x}}")
    (tmp_path / "smoke.yaml").write_text(overlay)
    with pytest.raises(EagletError, match=expected) as e:
        load(tmp_path / "smoke.yaml")
    assert "\n" not in str(e.value)


def test_the_shipped_smoke_overlay_is_the_example_cut_down(tmp_path):
    """examples/kimi-k2.5.smoke.yaml, copied beside the example as the runbook copies both to
    the project's root: the production file's stages and backends, smaller."""
    example = load(
        shutil.copy(ROOT / "examples" / "kimi-k2.5.params.yaml", tmp_path / "params.yaml")
    )
    smoke = load(shutil.copy(ROOT / "examples" / "kimi-k2.5.smoke.yaml", tmp_path / "smoke.yaml"))
    assert smoke.target == example.target and list(smoke.datasets) == list(example.datasets)
    for ds in example.datasets:
        assert smoke.dataset(ds)["max_samples"] <= 50 < example.dataset(ds)["max_samples"]
        assert smoke.dataset(ds)["format"] == example.dataset(ds)["format"]
    assert (
        smoke.data["budget"]["max_cost_usd"] == 5 and smoke.data["hidden"] == example.data["hidden"]
    )
    ev = smoke.drafter("kimi_k25_eagle3")["evaluate"]
    assert ev["engine_tensor_parallel_size"] == 8 and ev["num_steps"] == [3]


def test_snakemake_runs_only_where_the_params_file_is(tmp_path):
    """eaglet resolves paths against the params file's folder, Snakemake against its own: a
    params file elsewhere is refused in one line naming it, one in the folder passes."""
    from eaglet.params import run_here

    write_params(tmp_path, tiny_params())
    (tmp_path / "sub").mkdir()
    shutil.copy(tmp_path / "params.yaml", tmp_path / "sub" / "smoke.yaml")
    assert run_here(load(tmp_path / "params.yaml"), tmp_path).root == tmp_path
    with pytest.raises(EagletError, match=r"smoke\.yaml: a params file outside the folder") as e:
        run_here(load(tmp_path / "sub" / "smoke.yaml"), tmp_path)
    assert "\n" not in str(e.value)
