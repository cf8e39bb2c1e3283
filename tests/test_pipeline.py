"""End to end on the embedded target: prompts -> responses through the CLI (graph: test_graph)."""

import json
import shutil
import subprocess
import sys

import pytest

from eaglet.formats.io import read_jsonl
from eaglet.formats.records import RESPONSE_FIELDS
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
from eaglet.params import load

from .conftest import tiny_params, write_params

pytestmark = pytest.mark.slow


def eaglet(project, *args):
    r = subprocess.run(
        [sys.executable, "-m", "eaglet", *args, "--params", str(project / "params.yaml")],
        capture_output=True,
        text=True,
        cwd=project,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_cli_prompts_then_responses(project):
    write_params(project, tiny_params())
    prompts_path = eaglet(project, "prompts", "sg").stdout.strip()
    r = eaglet(project, "generate", "sg", "--quiet", "--threads", "2")
    out = r.stdout.strip()
    assert out == str(Keys(load(project / "params.yaml")).path("responses", "sg"))
    assert "responses sg: done 6/6" in r.stderr
    prompts = list(read_jsonl(prompts_path))
    recs = list(read_jsonl(out))
    assert [r["id"] for r in recs] == [p["id"] for p in prompts]  # prompt order
    tok = load_tokenizer(resolve(SMOLLM2))
    for rec, p in zip(recs, prompts, strict=True):
        assert set(rec) == set(RESPONSE_FIELDS)
        assert rec["messages"] == p["messages"] and rec["dataset"] == "sg"
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
    eaglet(project, "generate", "sg", "--quiet", "--out", str(project / "again.jsonl.zst"))
    again = list(read_jsonl(project / "again.jsonl.zst"))
    assert [a["output_ids"] for a in again] == [r["output_ids"] for r in recs]
