"""The vocab stage: the drafter's draft vocabulary and its maps to and from the target's.

The draft vocabulary is the `draft_vocab_size` most frequent target ids over the loss-masked
(assistant) tokens of the drafter's datasets (ties broken by the smaller id), padded with the
smallest unused ids if fewer occur, sorted ascending. d2t[i] = target_id - i (int64 offsets,
as SGLang and vLLM read them); t2d is a bool mask over the target vocab.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.vocab.kernel",
        "eaglet.stages.hidden.read:open_readers",
    ),
)
