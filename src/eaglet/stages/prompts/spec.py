"""The prompts stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.graph.keys import Keys, file_key


@dataclass(frozen=True)
class PromptsSpec:
    """What the prompt records' bytes depend on."""

    source_sha256: str  # the dataset file's bytes, not where it lies
    format: str
    max_samples: int | None
    seed: int
    max_prompt_tokens: int | None
    grammar: str  # spells the tool-call ids
    target: dict | None  # whose tokenizer counts prompt tokens (with max_prompt_tokens only)


def spec_of(keys: Keys, dataset: str) -> tuple[PromptsSpec, dict]:
    p = keys.params
    d = p.dataset(dataset)
    limit = d.get("max_prompt_tokens", p.data["prompts"].get("max_prompt_tokens"))
    spec = PromptsSpec(
        source_sha256=file_key(p, d["path"], f"datasets.{dataset}"),
        format=d["format"],
        max_samples=d.get("max_samples"),
        seed=d.get("prompt_seed", p.data["prompts"]["seed"]),
        max_prompt_tokens=limit,
        grammar=p.target["grammar"],
        target=keys.target_identity() if limit else None,
    )
    return spec, {}
