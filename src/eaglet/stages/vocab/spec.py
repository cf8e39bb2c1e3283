"""The vocab stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.graph.keys import Keys


@dataclass(frozen=True)
class VocabSpec:
    """What the draft vocab's bytes depend on (and the hidden states upstream)."""

    draft_vocab_size: int


def spec_of(keys: Keys, drafter: str) -> tuple[VocabSpec, dict]:
    spec = VocabSpec(keys.params.drafter(drafter)["draft_vocab_size"])
    return spec, {"hidden": keys.dataset_keys("hidden", drafter)}
