"""Bad input: one line naming the file, record or field, exit 2, and nothing produced lost.

A damaged record (a lone surrogate escape, bytes that are not UTF-8) is that record's error,
counted and shown with its line like any bad row; a damaged file or params file stops the
command with one line on stderr, never a traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglet.cli import main
from eaglet.errors import EagletError
from eaglet.formats.io import read_jsonl
from eaglet.formats.readers import iter_rows
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.params import load

from ..conftest import ROOT, write_params

TARGET = {"model": "smollm2-135m-instruct"}
GOOD = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "Name a fruit.", "output": "Apple."},
    {"instruction": "Smile \U0001f600 please", "output": "Done."},  # a valid pair: kept
]
# As scraped ShareGPT has it: a JSON escape of half a pair, which json.loads accepts.
LONE = '{"instruction": "Broken \\ud83d emoji", "output": "x"}'
LONE_ERROR = "text is not valid Unicode (lone surrogate \\ud83d in field instruction)"


def one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("eaglet: error: ")
    for name in names:
        assert name in err, err
    return err


def params_error(tmp_path: Path, data: dict) -> str:
    path = write_params(tmp_path, data)
    with pytest.raises(EagletError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# ---------------------------------------------------------------------------- damaged records


def jsonl_with_lone_surrogate() -> str:
    lines = [json.dumps(GOOD[0]), LONE, json.dumps(GOOD[1]), json.dumps(GOOD[2])]
    return "\n".join(lines) + "\n"


def test_lone_surrogate_row_is_counted_by_the_prompts_stage(tmp_path, capsys):
    (tmp_path / "scraped.jsonl").write_text(jsonl_with_lone_surrogate(), encoding="utf-8")
    path = write_params(tmp_path, {"target": TARGET, "datasets": {"s": {"path": "scraped.jsonl"}}})
    assert main(["prompts", "s", "--params", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert f"scraped.jsonl:2: skipped: {LONE_ERROR}" in err
    artifact = Path(out.strip().splitlines()[-1])
    kept = {r["messages"][0]["content"] for r in read_jsonl(artifact)}
    assert kept == {row["instruction"] for row in GOOD}
    stats = json.loads(sidecar_of(artifact).read_text(encoding="utf-8"))["stats"]
    assert stats["rows"] == 4 and stats["bad_rows"] == 1 and stats["kept"] == 3
    assert stats["bad_examples"] == [{"line": 2, "reason": LONE_ERROR}]


def write_json_array(path: Path, text_rows: list[str]) -> None:
    path.write_text("[" + ",\n".join(text_rows) + "]", encoding="utf-8")


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.json"])
def test_lone_surrogate_is_the_records_error(tmp_path, name):
    path = tmp_path / name
    if name == "d.json":
        write_json_array(path, [json.dumps(GOOD[0]), LONE, json.dumps(GOOD[1])])
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(jsonl_with_lone_surrogate().encode()))
    else:
        path.write_text(jsonl_with_lone_surrogate(), encoding="utf-8")
    rows = list(iter_rows(path))
    assert rows[0] == (1, GOOD[0], None)
    assert rows[1] == (2, None, LONE_ERROR)
    assert rows[2] == (3, GOOD[1], None)


def test_lone_surrogate_names_the_field_path(tmp_path):
    rows = [
        '{"conversations": [{"from": "human", "value": "ok"}, '
        '{"from": "gpt", "value": "\\udc00"}]}',
        '{"meta": {"t\\ud800g": 1}, "text": "ok"}',
        '{"text": "a literal backslash-u: \\\\ud83d is text, not an escape"}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    got = list(iter_rows(path))
    assert got[0][2] == (
        "text is not valid Unicode (lone surrogate \\udc00 in field conversations.1.value)"
    )
    assert (
        got[1][2]
        == "text is not valid Unicode (lone surrogate \\ud800 in field name meta.t\\ud800g)"
    )
    assert got[2][1] == {"text": "a literal backslash-u: \\ud83d is text, not an escape"}
    for _, _, error in got[:2]:
        error.encode("utf-8")  # the reason itself is printable and storable


def test_parquet_text_that_is_not_utf8_is_the_rows_error(tmp_path):
    texts = pa.array([b"fine", b"bad \xed\xa0\xbd bytes", b"also fine"], pa.binary())
    table = pa.table({"instruction": texts.view(pa.string()), "output": ["a", "b", "c"]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    assert list(iter_rows(path)) == [
        (1, {"instruction": "fine", "output": "a"}, None),
        (2, None, "text is not valid Unicode (invalid UTF-8 in field instruction)"),
        (3, {"instruction": "also fine", "output": "c"}, None),
    ]


# ---------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("folder", ["data/raw", "data/raw.jsonl"])
def test_directory_as_dataset_path_is_one_line(tmp_path, capsys, folder):
    (tmp_path / folder).mkdir(parents=True)
    path = write_params(tmp_path, {"target": TARGET, "datasets": {"s": {"path": folder}}})
    assert main(["prompts", "s", "--params", str(path)]) == 2
    one_error_line(capsys, "datasets.s.path", folder, "directory")
    with pytest.raises(EagletError, match=r"raw(\.jsonl)?: is a directory, not a dataset file"):
        iter_rows(tmp_path / folder)


def test_directory_as_suite_path_is_refused(tmp_path):
    (tmp_path / "suite").mkdir()
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    data = {
        "target": TARGET,
        "datasets": {"a": {"path": "a.jsonl"}},
        "drafters": {"d": {"datasets": ["a"], "evaluate": {"suites": {"s": {"path": "suite"}}}}},
    }
    msg = params_error(tmp_path, data)
    assert "drafters.d.evaluate.suites.s.path: suite is a directory" in msg


def test_unreadable_file_is_one_line(tmp_path, monkeypatch):
    """(Run as root, a chmod 000 file stays readable: the refusal is simulated.)"""
    from eaglet.formats import readers

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(readers, "_open_binary", denied)
    with pytest.raises(EagletError) as e:
        list(iter_rows(path))
    assert str(e.value) == f"{path}: cannot read (Permission denied)"

    monkeypatch.setattr(Path, "stat", denied)
    with pytest.raises(EagletError) as e:
        iter_rows(path)
    assert str(e.value) == f"{path}: cannot read (Permission denied)"


# ---------------------------------------------------------------------------- params refused


def test_duplicate_yaml_key_is_refused(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(
        "target: {model: smollm2-135m-instruct}\n"
        "datasets:\n"
        "  a: {path: a.jsonl, max_samples: 10}\n"
        "  b: {path: b.jsonl}\n"
        "  a: {path: a2.jsonl}\n"
    )
    assert main(["status", "--params", str(path)]) == 2
    one_error_line(capsys, str(path), "line 5", "duplicate key 'a'", "first on line 3")

    path.write_text(
        "target: {model: smollm2-135m-instruct}\ndatasets: {a: {path: a.jsonl, path: b.jsonl}}\n"
    )
    with pytest.raises(EagletError, match="line 2 invalid YAML: duplicate key 'path'"):
        load(path)


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(
        "target: {model: smollm2-135m-instruct}\n"
        "datasets:\n"
        "  a: &a {path: a.jsonl, format: alpaca}\n"
        "  b:\n"
        "    <<: *a\n"
        "    format: dolly\n"
    )
    assert load(path).dataset("b") == {"path": "a.jsonl", "format": "dolly"}


def test_dollar_budget_on_a_backend_without_cost_is_refused(tmp_path):
    data = {
        "target": TARGET,
        "backends": {"local": {"kind": "transformers"}},
        "datasets": {"a": {"path": "a.jsonl", "max_cost_usd": 5}},
    }
    msg = params_error(tmp_path, data)
    assert "datasets.a.max_cost_usd: backend 'local' (transformers) reports no cost" in msg
    r = main(["status", "--params", str(tmp_path / "params.yaml")])
    assert r == 2

    del data["datasets"]["a"]["max_cost_usd"]
    data["budget"] = {"max_cost_usd": 5}
    msg = params_error(tmp_path, data)
    assert "budget.max_cost_usd: no dataset's backend reports a cost" in msg
    assert "a: 'local' (transformers)" in msg


def test_dollar_budget_on_an_openai_backend_loads(tmp_path):
    """An openai backend reports the answers' usage.cost even without price_per_mtok; an overall
    budget holds over a project whose other datasets run on engines of its own (no dollars)."""
    data = {
        "target": TARGET,
        "backends": {
            "api": {"kind": "openai", "base_url": "https://api.example.com/v1", "model": "m"},
            "engine": {"kind": "sglang", "url": "http://127.0.0.1:30000"},
        },
        "generation": {"backend": "api"},
        "budget": {"max_cost_usd": 10},
        "datasets": {
            "a": {"path": "a.jsonl", "max_cost_usd": 5},
            "b": {"path": "b.jsonl", "backend": "engine", "token_budget": 1000},
        },
    }
    p = load(write_params(tmp_path, data))
    assert p.dataset("a")["max_cost_usd"] == 5 and p.data["budget"]["max_cost_usd"] == 10


def test_humaneval_is_not_a_training_format(tmp_path):
    data = {"target": TARGET, "datasets": {"code": {"path": "c.jsonl", "format": "humaneval"}}}
    msg = params_error(tmp_path, data)
    assert "datasets.code.format: humaneval is an evaluation suite only" in msg


def test_shipped_params_still_load(tmp_path):
    """Every shipped params file loads; the smoke overlay where the runbook puts it, at the
    project's root beside the example copied to params.yaml."""
    for path in [*ROOT.glob("params*.yaml"), ROOT / "examples" / "kimi-k2.5.params.yaml"]:
        assert load(path).datasets, path
    shutil.copy(ROOT / "examples" / "kimi-k2.5.params.yaml", tmp_path / "params.yaml")
    smoke = shutil.copy(ROOT / "examples" / "kimi-k2.5.smoke.yaml", tmp_path / "smoke.yaml")
    assert load(smoke).datasets
    assert sorted(p.name for p in (ROOT / "examples").glob("*.yaml")) == [
        "kimi-k2.5.params.yaml",
        "kimi-k2.5.smoke.yaml",
    ]


def eaglet_fails(*args: str, env: dict[str, str | None] | None = None) -> str:
    """`eaglet ARGS` in its own process: exit code 2 and one line on stderr, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None: unset
    cmd = [sys.executable, "-m", "eaglet", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (args, r.returncode, r.stderr)
    assert lines[0].startswith("eaglet: error: ")
    return lines[0]


STAGE_LIST = "(stages: prompts, responses, hidden, vocab, train, evaluate, sglang, vllm)"


def test_an_unknown_stage_or_name_in_eaglet_path_is_one_line():
    """`eaglet path export NAME` (an export is named by its format), an unknown stage, and a
    name that is not a drafter (or is a dataset): one line listing what there is."""
    params = ["--params", str(ROOT / "params.yaml")]
    err = eaglet_fails("path", "export", "kimi_k25_eagle3", *params)
    assert f"no stage 'export' {STAGE_LIST}; an export's stage is its format: " in err
    assert "eaglet path sglang kimi_k25_eagle3 or eaglet path vllm kimi_k25_eagle3" in err
    err = eaglet_fails("path", "drafter", "demo", *params)
    assert err.endswith(f"no stage 'drafter' {STAGE_LIST}")
    assert "no drafter 'nope' (known: demo)" in eaglet_fails("path", "train", "nope", *params)
    err = eaglet_fails("path", "train", "demo_questions", *params)
    assert "no drafter 'demo_questions' (known: demo); 'demo_questions' is a dataset, " in err
    assert err.endswith("its stages: prompts, responses, hidden")
    assert main(["path", "vllm", "demo", *params]) == 0
    with pytest.raises(EagletError, match=r"no stage 'export' .*its format: sglang or vllm"):
        Keys(load(ROOT / "params.yaml")).path("export", "demo")  # the library says it too


def _hub_project(tmp_path, **target) -> list[str]:
    (tmp_path / "a.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    data = {
        "target": {"model": "someorg/not-cached", **target},
        "datasets": {"a": {"path": "a.jsonl"}},
    }
    return ["--params", str(write_params(tmp_path, data))]


HUB_COMMANDS = (["keys"], ["status"], ["path", "hidden", "a"])


def test_a_hub_target_offline_and_not_cached_is_one_line(tmp_path):
    """HF_HUB_OFFLINE with a hub id not in an (empty) cache: `main` cannot be pinned to a
    commit. keys, status and path stop with one line naming the model and the ways out."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": None}
    args = _hub_project(tmp_path)
    for cmd in HUB_COMMANDS:
        err = eaglet_fails(*cmd, *args, env=env)
        assert "target.revision: 'main' of someorg/not-cached is a moving ref" in err, cmd
        assert "pin its commit (target.revision: <40 hex>)" in err
        assert "hf download someorg/not-cached --revision main" in err
        assert "or unset HF_HUB_OFFLINE" in err


def test_an_unreachable_hub_is_one_line(tmp_path):
    """Online, the hub refusing connections: resolving `main` is one line that says what to
    do, naming the model."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": None}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    args = _hub_project(tmp_path)
    for cmd in HUB_COMMANDS:
        err = eaglet_fails(*cmd, *args, env=env)
        assert "target.revision: cannot resolve 'main' of someorg/not-cached on the hub (" in err
        assert "pin its commit (target.revision: <40 hex>), or download it into the hub " in err
        assert "(hf download someorg/not-cached --revision main) and set HF_HUB_OFFLINE=1" in err


def test_a_hub_target_neither_cached_nor_reachable_is_one_line(tmp_path, capsys, monkeypatch):
    """Offline (HF_HUB_OFFLINE, as in the tests) and not in the cache: keys, status and path
    stop with one line that says what to do."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "a.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    commit = "0123456789abcdef0123456789abcdef01234567"
    data = {
        "target": {"model": "moonshotai/Kimi-K2.5", "revision": commit, "trust_remote_code": True},
        "datasets": {"a": {"path": "a.jsonl"}},
    }
    args = ["--params", str(write_params(tmp_path, data))]
    for cmd in (["keys"], ["status"], ["path", "hidden", "a"]):
        assert main([*cmd, *args]) == 2, cmd
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "config.json is not in the local hub cache" in err
        assert "download the model first" in err
