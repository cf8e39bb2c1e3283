"""The prompts stage: a raw dataset file in any supported schema -> prompt records.

Rows are adapted to messages, cut before the last assistant turn (the target regenerates it),
deduplicated by content id, shuffled by a seed, optionally filtered by prompt length in target
tokens, and capped at `max_samples`. Bad rows are skipped, counted and reported with line numbers.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=2,
    kernel=(
        "eaglet.stages.prompts.kernel",
        "eaglet.formats.datasets",
        "eaglet.formats.records",
        "eaglet.formats.grammar",
        "eaglet.formats.chat",
        "eaglet.formats.io:write_jsonl_zst",
        "eaglet.formats.io:dumps",
        "eaglet.formats.io:_end_marker",
    ),
)
