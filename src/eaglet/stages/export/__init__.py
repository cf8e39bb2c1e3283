"""The export stages (sglang, vllm): a trained drafter written as an SGLang draft folder or a
speculators (vLLM) one (the formats: eaglet.formats.exports), each checked by a validator that
reloads it from its files alone.

The validator checks every required field and tensor, their shapes and the vocab maps, then
runs a probe through the reloaded drafter and the trained one and requires the same outputs.
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.export.kernel",
        "eaglet.formats.exports",
        "eaglet.model.drafter",
        "eaglet.formats.drafter:load_drafter",
        "eaglet.formats.dflash_export",
        "eaglet.stages.export.dflash:validate",
        "eaglet.formats.dflash:load_dflash",
    ),
)
