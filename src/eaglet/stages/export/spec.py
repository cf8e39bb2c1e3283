"""The sglang and vllm stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.errors import EagletError
from eaglet.graph.keys import Keys
from eaglet.model.target import reference

FORMATS = ("sglang", "vllm")


@dataclass(frozen=True)
class ExportSpec:
    """What an export's bytes depend on (and the trained drafter upstream)."""

    format: str  # sglang or vllm
    num_steps: int  # the fewest the drafter is evaluated at: the serving command's
    verifier: str  # the target as the engine names it
    verifier_architectures: list | None
    arch_differs_from_target: dict


def spec_of(keys: Keys, drafter: str, fmt: str) -> tuple[ExportSpec, dict]:
    if fmt not in FORMATS:
        raise EagletError(f"export: unknown format '{fmt}' (known: {', '.join(FORMATS)})")
    p = keys.params
    spec = ExportSpec(
        format=fmt,
        num_steps=min(p.drafter(drafter)["evaluate"]["num_steps"]),
        verifier=reference(keys.target, p.target.get("hub_id"), p.root),
        verifier_architectures=keys.target_config[0].get("architectures"),
        arch_differs_from_target=keys.spec("train", drafter).values.arch_differs_from_target,
    )
    return spec, {"train": keys.key("train", drafter)}
