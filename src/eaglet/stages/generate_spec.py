"""The responses stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.graph.keys import Keys


@dataclass(frozen=True)
class ResponsesSpec:
    """What the response records' bytes depend on."""

    backend: dict  # the backend's identity: whose answers (never its endpoint or threads)
    sampling: dict
    token_budget: int | None
    max_cost_usd: float | None
    grammar: str  # writes the text answers as the target's tokens
    max_length: int  # longer prompts are left out
    target: dict  # generates, or tokenizes the answers of an API


def spec_of(keys: Keys, dataset: str) -> tuple[ResponsesSpec, dict]:
    p = keys.params
    sampling = p.generation(dataset)
    sampling.pop("max_token_drift")  # a check: stops or passes, changes no byte
    d = p.dataset(dataset)
    spec = ResponsesSpec(
        backend=p.backend_identity(sampling.pop("backend")),
        sampling=sampling,
        token_budget=d.get("token_budget"),
        max_cost_usd=d.get("max_cost_usd"),
        grammar=p.target["grammar"],
        max_length=p.max_length(dataset),
        target=keys.target_identity(),
    )
    return spec, {"prompts": keys.key("prompts", dataset)}
