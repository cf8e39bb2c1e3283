"""The responses stage: the target regenerates the assistant turns of every conversation.

Which turns, and what each is asked with, is `eaglet.stages.responses.turns`: every turn by
default, turn k after the target's own answers to turns 1..k-1; one record per turn (`<id>/<k>`
where a conversation has several). A replayed turn is asked once the turn before it is answered, so
dispatch walks the prompts again while a walk asked for something a later turn waits on.

Each record holds the tokens the target generated (`output_ids`): an engine's own, or a text
answer written in the target's output grammar and checked by round trip (`formats/stream.py`);
their count against the server's is checked per dataset (`generation.max_token_drift`).

Prompts stream from the prompts artifact in their seeded order. Each turn is looked up in the
response store by its request key; misses go to the backend through a bounded queue and a fixed
pool of `concurrency` workers (never one task per prompt), and every outcome is committed to the
store before it counts as done. So a rerun after Ctrl-C or kill -9 sends only what is missing,
and failed prompts are retried.

Budgets (`token_budget`, `max_cost_usd` per dataset) cut the output to the longest prefix of
the prompt order whose answers (every turn of a conversation) fit them. Dispatch follows the
order and stops once the prefix, with in-flight answers counted at the mean size seen so far,
passes a budget; what is in flight finishes and stays in the store. The file is then written
from the store alone, so it does not depend on timing: the same store gives the same file. The
overall `budget:` caps the project's spend: when reached, dispatch stops and the stage fails (it
never shortens an output, so no byte depends on it). Spend is what `budget.count` says:
`this_run` (the default), the answers this params file generated, the store's answers of unknown
origin included, never imported answers or other params files' (reported beside); `store`, every
answer in the store.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=5,
    kernel=(
        "eaglet.stages.responses.kernel",
        "eaglet.stages.responses.turns",
        "eaglet.formats.stream",
        "eaglet.formats.grammar",
        "eaglet.formats.chat",
        "eaglet.formats.records",
        "eaglet.formats.io:write_jsonl_zst",
        "eaglet.formats.io:dumps",
        "eaglet.formats.io:_end_marker",
    ),
)
