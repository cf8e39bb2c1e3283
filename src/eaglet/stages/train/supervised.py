"""The share of answer positions a drafter's training supervises, per dataset.

Training learns a position only where the target's own next-token argmax (from its stored final
state) is a draft-vocabulary id. A target reading its own answers through its own template and
ids predicts them, so most positions count; a low share means ids, a template or answers that
are not the target's, and a drafter that learned nothing. The share is measured before training
on the first `SAMPLES` samples of each dataset (reader order), so a bad dataset stops the stage
before it spends any compute.
"""

from __future__ import annotations

import torch

from eaglet.errors import EagletError
from eaglet.model import ttt
from eaglet.model.target_head import TargetHead, shift

SAMPLES = 64  # per dataset: enough for a share to within a few percent, cheap at any scale


def shares(
    readers: list, names: list[str], lm_head: torch.Tensor, t2d: torch.Tensor, max_length: int
) -> dict[str, dict]:
    """Per dataset: supervised positions / answer positions (those whose next token is an
    assistant token), over its first SAMPLES samples."""
    head = TargetHead(lm_head, t2d)
    out = {}
    for i, (name, reader) in enumerate(zip(names, readers, strict=True)):
        hits = positions = 0
        ids = reader.ids[:SAMPLES]
        for sid in ids:
            s = ttt.load(readers, [(i, sid)], max_length)
            rows = s["last"][0][shift(s["loss_mask"], 1)[0]]
            hits += int(head.argmax_in_draft(rows).sum())
            positions += len(rows)
        share = round(hits / positions, 4) if positions else None
        out[name] = {"share": share, "positions": positions, "samples": len(ids)}
    return out


def check(found: dict[str, dict], minimum: float, drafter: str) -> None:
    """Stop at the first dataset whose share is below `minimum`, naming it."""
    for name, s in found.items():
        if s["share"] is not None and s["share"] < minimum:
            raise EagletError(
                f"drafters.{drafter}: dataset '{name}': the target's next-token argmax is a "
                f"draft-vocabulary id at {s['share']:.1%} of {s['positions']} answer positions "
                f"(first {s['samples']} samples), below train.min_supervised_share {minimum}: "
                "its ids, template or answers are not the target's"
            )
