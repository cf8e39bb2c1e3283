"""The responses stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

import random
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
    mode: dict | None  # thinking on, off or a seeded mix (None: the template's default)
    truncated: str  # drop or keep the answers cut at max_new_tokens
    marker_text: str  # skip or keep the text answers holding a marker's text
    turns: str  # the assistant turns regenerated: all (each after the target's own), or last


def spec_of(keys: Keys, dataset: str) -> tuple[ResponsesSpec, dict]:
    p = keys.params
    sampling = p.generation(dataset)
    sampling.pop("max_token_drift")  # a check: stops or passes, changes no byte
    thinking, fraction = sampling.pop("thinking"), sampling.pop("thinking_fraction")
    truncated = sampling.pop("truncated")  # what is kept of the answers, not how they are asked
    marker_text = sampling.pop("marker_text")
    turns = sampling.pop("turns")
    mode = None
    if thinking is not None:
        mode = {"switch": p.target["thinking_switch"], "thinking": thinking}
        if thinking == "mix":
            mode |= {"fraction": fraction, "seed": sampling["seed"]}
    d = p.dataset(dataset)
    spec = ResponsesSpec(
        backend=p.backend_identity(sampling.pop("backend")),
        sampling=sampling,
        token_budget=d.get("token_budget"),
        max_cost_usd=d.get("max_cost_usd"),
        grammar=p.target["grammar"],
        max_length=p.max_length(dataset),
        target=keys.target_identity(),
        mode=mode,
        truncated=truncated,
        marker_text=marker_text,
        turns=turns,
    )
    return spec, {"prompts": keys.key("prompts", dataset)}


def sample_mode(mode: dict | None, prompt_id: str) -> dict | None:
    """The template arguments one prompt is answered with (`{"thinking": False}`), or None for
    the template's default. A mix draws per prompt from its id and the seed, so a prompt keeps
    its mode whatever the order, the count or the machine."""
    if mode is None:
        return None
    on = mode["thinking"]
    if on == "mix":
        on = random.Random(f"{mode['seed']}:{prompt_id}").random() < mode["fraction"]
    return {mode["switch"]: bool(on)}
