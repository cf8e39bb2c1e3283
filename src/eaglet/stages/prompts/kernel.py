"""What decides the prompts' bytes: which records are kept, in what order (reading and
adapting the rows is eaglet.formats.datasets.collect)."""

from __future__ import annotations

import random


def select(
    records: list[dict], seed: int, max_samples: int | None, too_long=None
) -> tuple[list[dict], dict]:
    """Dedup by id, shuffle deterministically, drop over-long prompts, cap at max_samples."""
    unique: dict[str, dict] = {}
    for rec in records:
        unique.setdefault(rec["id"], rec)
    order = sorted(unique)  # independent of file order, so ids alone fix the result
    random.Random(seed).shuffle(order)
    kept, dropped_long = [], 0
    for pid in order:
        if max_samples is not None and len(kept) >= max_samples:
            break
        if too_long is not None and too_long(unique[pid]):
            dropped_long += 1
            continue
        kept.append(unique[pid])
    stats = {"duplicates": len(records) - len(unique), "too_long": dropped_long, "kept": len(kept)}
    return kept, stats
