"""vLLM's speculative decoding, as data in and out: the speculative config a drafter is served
with (`eagle3`, `dflash`: what `--speculative-config` gets) and the counters its `GET /metrics`
exposes (`spec_counters`, `SpecCounters.summary`: acceptance length and per-position rates).
Pure functions over text and dicts: the evaluate stage's kernel holds them, and the engine
(eaglet.engines.vllm.server) only serves and returns the text.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field


def eagle3(draft: str | os.PathLike, num_steps: int) -> dict:
    """The speculative config of an EAGLE-3 drafter in vLLM's (speculators) format."""
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_steps}


def dflash(draft: str | os.PathLike, num_steps: int) -> dict:
    """The speculative config of a DFlash drafter (z-lab's layout): num_steps = block_size - 1,
    the masks it drafts a round (vLLM does not read block_size)."""
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens": num_steps}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines); subtract two for a run."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)
    generation_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        keys = set(self.per_position) | set(other.per_position)
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            {k: self.per_position.get(k, 0.0) - other.per_position.get(k, 0.0) for k in keys},
            self.generation_tokens - other.generation_tokens,
        )

    def summary(self) -> dict:
        """Mean acceptance length (1 + accepted / drafts, vLLM's definition), the acceptance
        rate at each draft position given the ones before it, and the raw counts."""
        drafts = self.drafts
        positions = [self.per_position[k] for k in sorted(self.per_position)]
        before = [drafts, *positions[:-1]]
        rates = [p / b if b else 0.0 for p, b in zip(positions, before, strict=True)]
        return {
            "acceptance_length": 1 + self.accepted / drafts if drafts else None,
            "acceptance_rate": rates,
            "accepted_per_position": [p / drafts if drafts else 0.0 for p in positions],
            "drafts": int(drafts),
            "draft_tokens": int(self.draft_tokens),
            "accepted_tokens": int(self.accepted),
            "generation_tokens": int(self.generation_tokens),
        }


def spec_counters(text: str) -> SpecCounters:
    """The speculative-decoding counters in a Prometheus text exposition."""
    c = SpecCounters()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_drafts_total":
            c.drafts += value
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            c.draft_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            c.accepted += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = _POSITION.search(labels)
            if pos:
                k = int(pos.group(1))
                c.per_position[k] = c.per_position.get(k, 0.0) + value
        elif name == "vllm:generation_tokens_total":
            c.generation_tokens += value
    return c
