"""The one lookup of the engine layer: the engine a params field names, if it can do the job.

Each engine module declares `CAN`, a subset of JOBS, and has a factory per job it can do:
`generator(name, cfg, target, max_length, threads)` for the responses stage,
`hidden_states(cfg, target, layer_ids, threads)` for the hidden stage; each takes resolved
values, never params. Asking an engine for a job it cannot do (say `hidden.backend: openai`) is
a one-line error naming the field.

A generator answers batches of requests. `plan` groups `window` consecutive requests into the
batches it wants (the in-process model sorts a window by length into batches of `batch_size`; a
server takes one request at a time), and `concurrency` says how many batches may be in flight.
Request: {"id", "messages", "sampling"}. Result (per request, same order): {"response",
"reasoning", "output_ids" (or None), "prompt_tokens", "completion_tokens", "finish_reason",
"model", "cost" (or None), "latency_s", "attempts", "meta"}; or, once retries are spent,
{"error", "attempts"}. A failure every request would share raises `Abort`.

A hidden-states engine takes batches of token-id sequences (`run`) and returns, per sequence,
`aux` [T, K, H] (outputs of the decoder layers `layer_ids`, SGLang convention) and `last` [T, H]
(the final state after the final norm, i.e. the lm_head input), on the CPU; `close` ends it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

from eaglet.errors import EagletError

JOBS = {
    "generate": "generate responses",
    "hidden": "give hidden states",
    "speculate": "decode with a drafter",
}
ENGINES = ("transformers", "vllm", "sglang", "openai")


class Backend(Protocol):
    name: str
    concurrency: int
    batch_size: int
    window: int

    def plan(self, requests: list[dict]) -> list[list[dict]]: ...

    async def generate(self, batch: list[dict]) -> list[dict]: ...

    async def close(self) -> None: ...


def engine(kind: str, job: str, field: str) -> ModuleType:
    """The engine module `kind`, checked to be able to do `job`; `field` names who asked."""
    # Imported by name, one branch each: the code key follows these imports (never a computed
    # name), and a stage imports only the engine it uses.
    if kind == "transformers":
        from eaglet.engines import transformers as module
    elif kind == "vllm":
        from eaglet.engines import vllm as module
    elif kind == "sglang":
        from eaglet.engines import sglang as module
    elif kind == "openai":
        from eaglet.engines import openai as module
    else:
        raise EagletError(f"{field}: no engine '{kind}' (engines: {', '.join(ENGINES)})")
    if job not in module.CAN:
        can = ", ".join(j for j in JOBS if j in module.CAN)
        raise EagletError(f"{field}: {kind} cannot {JOBS[job]} (it can: {can})")
    return module


def generator(
    kind: str, name: str, cfg: dict, target: Any, max_length: int, threads: int | None = None
) -> Backend:
    """The generation backend `backends.<name>` (of kind `kind`, settings `cfg`) for the target
    `target` (a TargetSpec), ready to answer; `max_length` is a served engine's context."""
    module = engine(kind, "generate", f"backends.{name}.kind")
    return module.generator(name, cfg, target, max_length, threads)


def hidden_states(
    kind: str, cfg: dict, target: Any, layer_ids: list[int], threads: int | None = None
):
    """The hidden-states engine `kind` (`hidden.backend`) with its settings `cfg` (`hidden.*`,
    device and dtype resolved), for `target` (eaglet.stages.hidden.kernel's Target: spec, config,
    max_length) and the aux layers `layer_ids`."""
    module = engine(kind, "hidden", "hidden.backend")
    return module.hidden_states(cfg, target, layer_ids, threads)
