"""The evaluate stage: how many tokens the target accepts per verification with this drafter.

Per suite (eaglet.stages.evaluate.suites: the natural held-out prompts, HumanEval, any prompt file
a user names), real greedy chain speculative decoding (eaglet.model.speculative) of the target for
each `num_steps`: acceptance length (generated tokens / verification rounds, bonus token included,
as SGLang counts), acceptance per draft position, and the check that every output equals plain
greedy decoding of the target; and at each sampled temperature, speculative sampling (the
rule the engines serve with: argmax proposals, the standard rejection rule). Also a fast offline
estimate from the drafter's held-out hidden states: the teacher-forced chain from every
assistant position (what chain decoding would accept there, without running the target). With
`engine: vllm`, every suite is run by vLLM serving the target with the drafter's vLLM export
(eaglet.stages.evaluate.engine) first, greedy and at each sampled temperature; the engine's plain
greedy text is then the reference both greedy speculative outputs must equal (eaglet does not
decode it again), and the engine's mean acceptance length is the headline, stated next to eaglet's
own. Writes metrics.json and PNG plots: acceptance per position, per suite and temperature, and the
training loss.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.evaluate.kernel",
        "eaglet.stages.evaluate.run:measure_suites",
        "eaglet.stages.evaluate.engine:measure",
        "eaglet.stages.evaluate.engine:_speculative",
        "eaglet.stages.evaluate.engine:engine_metrics",
        "eaglet.stages.evaluate.suites",
        "eaglet.model.speculative",
        "eaglet.model.drafter",
        "eaglet.model.target_head",
        # the chain evaluate runs (not the training loss: scorer, ttt_batch)
        "eaglet.model.ttt:Run",
        "eaglet.model.ttt:step_masks",
        "eaglet.model.ttt:prepare",
        "eaglet.model.ttt:chain_accepted",
        "eaglet.model.ttt:accepted_counts",
        "eaglet.model.ttt:collate",
        "eaglet.model.ttt:load",
        "eaglet.formats.drafter:load_drafter",
        "eaglet.stages.hidden.read:is_heldout",
        "eaglet.stages.hidden.read:split",
        "eaglet.formats.speculative",
        "eaglet.formats.metrics",  # the writers of metrics.json and the sidecar's stats
        "eaglet.model.sampling",
    ),
)
