"""The prompts stage: a raw dataset file in any supported schema -> prompt records.

Rows are adapted to messages, cut before the last assistant turn (the target regenerates it),
deduplicated by content id, shuffled by a seed, optionally filtered by prompt length in target
tokens, and capped at `max_samples`. Bad rows are skipped, counted and reported with line numbers.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.datasets import BadRow, prompt_of, to_messages, tools_of
from eaglet.formats.grammar import Grammar, grammar, rename_calls
from eaglet.formats.io import write_json, write_jsonl_zst
from eaglet.formats.readers import iter_rows
from eaglet.formats.records import prompt_record
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model.target import TargetSpec
from eaglet.stages.prompts_spec import PromptsSpec

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=2,
    kernel=(
        "eaglet.stages.prompts:collect",
        "eaglet.stages.prompts:select",
        "eaglet.formats.datasets",
        "eaglet.formats.records",
        "eaglet.formats.grammar",
        "eaglet.formats.chat",
        "eaglet.formats.io:write_jsonl_zst",
        "eaglet.formats.io:dumps",
        "eaglet.formats.io:_end_marker",
    ),
)

SHOWN_ERRORS = 5


def collect(
    source: Path, fmt: str, dataset: str, g: Grammar | None = None
) -> tuple[list[dict], dict]:
    """Read and adapt every row of `source`; return prompt records (file order) and stats.
    Tool-call ids are the target's own (grammar `g`), as it wrote them in the conversation."""
    records, bad = [], []
    rows = 0
    for line, row, error in iter_rows(source):
        rows += 1
        try:
            if error is not None:
                raise BadRow(error)
            messages = prompt_of(to_messages(row, fmt))
            messages = rename_calls(messages, g) if g else messages
            tools = tools_of(row)
        except BadRow as e:
            bad.append({"line": line, "reason": str(e)})
            continue
        records.append(prompt_record(dataset, messages, line, tools))
    if not records:
        first = f" (first: line {bad[0]['line']}: {bad[0]['reason']})" if bad else ""
        raise EagletError(f"{source}: no valid prompt in {rows} rows{first}")
    return records, {"rows": rows, "bad_rows": len(bad), "bad_examples": bad[:SHOWN_ERRORS]}


def select(
    records: list[dict], seed: int, max_samples: int | None, too_long=None
) -> tuple[list[dict], dict]:
    """Dedup by id, shuffle deterministically, drop over-long prompts, cap at max_samples."""
    unique: dict[str, dict] = {}
    for rec in records:
        unique.setdefault(rec["id"], rec)
    order = sorted(unique)  # independent of file order, so ids alone fix the result
    random.Random(seed).shuffle(order)
    kept, dropped_long = [], 0
    for pid in order:
        if max_samples is not None and len(kept) >= max_samples:
            break
        if too_long is not None and too_long(unique[pid]):
            dropped_long += 1
            continue
        kept.append(unique[pid])
    stats = {"duplicates": len(records) - len(unique), "too_long": dropped_long, "kept": len(kept)}
    return kept, stats


@dataclass(frozen=True)
class Setup:
    """Beside the spec: the dataset file (its hash is in the spec) and, when prompts are cut by
    length, where the target's tokenizer is."""

    source: Path
    target: TargetSpec | None


def setup(keys: Keys, spec: Spec[PromptsSpec]) -> Setup:
    target = keys.target if spec.values.max_prompt_tokens else None
    return Setup(keys.params.resolve(keys.params.dataset(spec.name)["path"]), target)


def run(spec: Spec[PromptsSpec], setup: Setup, out: Path) -> Path:
    """Write the prompt records `spec` describes, and their sidecar, at `out`."""
    v, source = spec.values, setup.source
    records, stats = collect(source, v.format, spec.name, grammar(v.grammar))
    for b in stats["bad_examples"]:
        print(f"eaglet: {source}:{b['line']}: skipped: {b['reason']}", file=sys.stderr)
    if stats["bad_rows"] > len(stats["bad_examples"]):
        print(f"eaglet: {source}: {stats['bad_rows']} bad rows in all", file=sys.stderr)
    too_long = None
    limit = v.max_prompt_tokens
    if limit:
        from eaglet.formats.chat import prompt_ids
        from eaglet.model.target import load_tokenizer

        tok = load_tokenizer(setup.target)

        def too_long(rec: dict) -> bool:
            return len(prompt_ids(tok, rec["messages"], rec.get("tools"))) > limit

    kept, more = select(records, v.seed, v.max_samples, too_long)
    stats.update(more)
    write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
    write_jsonl_zst(out, kept)
    return out
