"""End to end on the embedded target: prompts -> responses through the CLI (graph: test_graph)."""

import json
import shutil

import pytest

from eaglet.formats.io import read_jsonl
from eaglet.formats.records import RESPONSE_FIELDS
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
from eaglet.params import load
from eaglet.stages.responses.turns import cuts

from ..cli import eaglet
from ..conftest import tiny_params, write_params

pytestmark = pytest.mark.slow


def test_cli_prompts_then_responses(project):
    write_params(project, tiny_params())
    params = project / "params.yaml"
    prompts_path = eaglet("prompts", "sg", params=params, check=True).stdout.strip()
    r = eaglet("generate", "sg", "--quiet", "--threads", "2", params=params, check=True)
    out = r.stdout.strip()
    assert out == str(Keys(load(project / "params.yaml")).path("responses", "sg"))
    prompts = list(read_jsonl(prompts_path))
    turns = [len(cuts(p["messages"], "all")) for p in prompts]  # every assistant turn
    assert max(turns) > 1 and f"responses sg: done {sum(turns)}/{sum(turns)}" in r.stderr
    recs = list(read_jsonl(out))
    want = [
        p["id"] if n == 1 else f"{p['id']}/{k}"
        for p, n in zip(prompts, turns, strict=True)
        for k in range(1, n + 1)
    ]
    assert [r["id"] for r in recs] == want  # prompt order, then turn order
    tok = load_tokenizer(resolve(SMOLLM2))
    by_id = {r["id"]: r for r in recs}
    for rec in recs:
        p = next(p for p in prompts if p["id"] == rec["id"].split("/")[0])
        k = int(rec["id"].split("/")[1]) if "/" in rec["id"] else 1
        users = [m for m in p["messages"] if m["role"] == "user"]
        # turn k: the dataset's user turns 1..k after the target's own answers to turns 1..k-1
        own = [by_id[f"{p['id']}/{j}"]["response"] for j in range(1, k)]
        assert [m for m in rec["messages"] if m["role"] == "user"] == users[:k]
        assert [m["content"] for m in rec["messages"] if m["role"] == "assistant"] == own
        assert set(rec) == set(RESPONSE_FIELDS) and rec["dataset"] == "sg"
        assert rec["backend"] == "local" and rec["model"] == SMOLLM2
        assert 1 <= rec["completion_tokens"] == len(rec["output_ids"]) <= 8
        assert rec["finish_reason"] == ("stop" if rec["output_ids"][-1] == 2 else "length")
        assert tok.decode(rec["output_ids"], skip_special_tokens=True) == rec["response"]
        assert rec["response"].strip()
    side = json.loads(sidecar_of(out).read_text())
    assert side["stats"]["completion_tokens"] == sum(r["completion_tokens"] for r in recs)
    assert side["provenance"]["upstream"]["prompts"] in prompts_path
    # greedy decoding is deterministic: a rebuild gives the same texts
    (project / "again.jsonl.zst").unlink(missing_ok=True)
    shutil.rmtree(project / "data" / "cache")  # regenerate rather than read the response store
    copy = project / "again.jsonl.zst"
    eaglet("generate", "sg", "--quiet", "--out", copy, params=params, check=True)
    again = list(read_jsonl(project / "again.jsonl.zst"))
    assert [a["output_ids"] for a in again] == [r["output_ids"] for r in recs]
