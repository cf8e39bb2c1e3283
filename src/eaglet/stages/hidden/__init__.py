"""The hidden-states stage: the target re-reads every prompt + response; its features are stored.

Per response the sequence is the prompt as the target's template renders it with the
generation prompt, then exactly the tokens the target generated (`output_ids`, end token
included: the engine's, or a text answer written in the target's grammar by the responses
stage). The loss mask is True on the generated tokens only. Each sequence is cut at the
dataset's `max_length` (default `target.max_length`).

The target is run once per sequence (batched by length) and the outputs of the aux layers
(SGLang ids, default [1, N//2-1, N-4]) and the final post-norm state are stored in shards
(`eaglet.formats.hidden_store`), built in a partial directory that survives kills and resumes
shard by shard. Layer conventions: SGLang id i = output of decoder layer i = vLLM id i+1 =
index i+1 of transformers' `output_hidden_states`, whose last entry (N) is the post-norm state.

Growth computes only what is new: a sample whose states another complete directory of the
dataset already holds (a sibling of the output whose provenance gives the same states,
`same_states`, listing the same id, response hash and token count) is read from it, shard by
shard with its SHA-256 checked, and written exactly as a computed one (`Reuse`); only the rest
goes through the target, which is not loaded at all when nothing is left. The directory's bytes
are the same either way; its sidecar counts `reused`, `computed` and the keys `reused_from`.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.hidden.kernel",
        "eaglet.formats.hidden_store",
        "eaglet.formats.chat",
        "eaglet.formats.records:conversation_of",
        "eaglet.model.capture",
    ),
)
