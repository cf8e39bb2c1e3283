"""A drafter's data mixture: how many samples of each dataset an epoch trains on, and in which
order (docs/drafter.md, Mixture weights).

A drafter names its datasets as a list (each sample once per epoch, all shuffled together: the
order `Steps` has always drawn) or with weights, `datasets: {code: 2, chat: 1}`. A weight is a
share of the epoch's *samples*: an epoch trains as many samples as the list form would (the
steps an epoch has, times the global batch), and dataset i gets exactly
`round(epoch_samples x w_i / sum(w))` of them, the rounding by largest remainder (ties to the
dataset named first), so the counts add up. A dataset asked for no more samples than its
training split holds gives a seeded draw without replacement; one up-weighted beyond its size
repeats every sample floor(count/size) times and draws the rest without replacement (so no sample
is seen twice more often than another). The epoch's samples are then shuffled together, seeded
by the run's seed and the epoch: the same order on every rerun, resume and process count.

Pure functions of the references, the weights and the seed: no torch, no reader.
"""

from __future__ import annotations

import random
from fractions import Fraction

Ref = tuple[int, str]  # (reader index, sample id), as eaglet.stages.hidden.read


def weights_of(datasets: list | dict) -> dict | None:
    """{dataset: weight} of a drafter's `datasets` in the weighted form, None in the list form."""
    return dict(datasets) if isinstance(datasets, dict) else None


def exact(w: int | float) -> Fraction:
    """A weight as the exact number it is written as (0.1 is 1/10, not the nearest double)."""
    return Fraction(repr(w)) if isinstance(w, float) else Fraction(w)


def counts(weights: list, total: int) -> list[int]:
    """`total` split in proportion to `weights`, exactly: each gets the floor of its share, and
    what is left goes one each to the largest remainders (ties: the earlier dataset)."""
    ws = [exact(w) for w in weights]
    whole = sum(ws)
    shares = [total * w / whole for w in ws]
    out = [int(s) for s in shares]  # floor: shares are not negative
    left = total - sum(out)
    by_remainder = sorted(range(len(ws)), key=lambda i: (-(shares[i] - out[i]), i))
    for i in by_remainder[:left]:
        out[i] += 1
    return out


def pools(train: list[Ref], n: int) -> list[list[Ref]]:
    """The training references of each of `n` readers, in their order."""
    out: list[list[Ref]] = [[] for _ in range(n)]
    for ref in train:
        out[ref[0]].append(ref)
    return out


def draw(pool: list[Ref], count: int, rng: random.Random) -> list[Ref]:
    """`count` references of `pool`: without replacement up to its size, beyond it every one
    floor(count/size) times and the rest without replacement."""
    full, rest = divmod(count, len(pool)) if pool else (0, 0)
    return pool * full + rng.sample(pool, rest)


def order(train: list[Ref], weights: list, total: int, seed: int) -> list[Ref]:
    """One epoch of `total` samples, per dataset `counts(weights, total)`, shuffled (seeded)."""
    rng = random.Random(seed)
    picked: list[Ref] = []
    for pool, count in zip(pools(train, len(weights)), counts(weights, total), strict=True):
        picked += draw(pool, count, rng)
    rng.shuffle(picked)
    return picked


def empty(names: list[str], weights: list, train: list[Ref]) -> str | None:
    """The first dataset given a weight above 0 and no training sample (all held out, or
    skipped as overlong), if any."""
    for name, w, pool in zip(names, weights, pools(train, len(weights)), strict=True):
        if w and not pool:
            return name
    return None


def tally(
    batches, names: list[str], tokens: dict[Ref, int], cap: int, out: dict | None = None
) -> dict[str, dict]:
    """Per dataset what the global `batches` (lists of references) trained: samples (repeats
    counted), tokens (each cut at `cap`) and optimizer steps it had a sample in; added to
    `out`'s counts when given."""
    if out is None:
        out = {n: {"samples": 0, "tokens": 0, "steps": 0} for n in names}
    for batch in batches:
        seen = set()
        for ref in batch:
            row = out[names[ref[0]]]
            row["samples"] += 1
            row["tokens"] += min(tokens[ref], cap)
            seen.add(ref[0])
        for i in seen:
            out[names[i]]["steps"] += 1
    return out
