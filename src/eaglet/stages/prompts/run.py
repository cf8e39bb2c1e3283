"""The prompts stage's run: the dataset file, the tokenizer that cuts prompts by length,
the records and their sidecar written."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from eaglet.formats.datasets import collect
from eaglet.formats.grammar import grammar
from eaglet.formats.io import write_json, write_jsonl_zst
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model.target import TargetSpec
from eaglet.stages.prompts.kernel import select
from eaglet.stages.prompts.spec import PromptsSpec


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
