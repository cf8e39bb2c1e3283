"""What the drafter stages read: the hidden states of a drafter's datasets, split and batched.

A sample (eaglet.formats.hidden_store.HiddenReader) holds input_ids [T], loss_mask [T] (true on the
assistant tokens), aux [T, 3, H] (target layers low, mid, high) and last [T, H] (the lm_head
input). A sample is held out when a hash of its id falls below `heldout_fraction`, so the split
depends neither on order nor seed nor on which other datasets are mixed in, and a prompt shared
by two datasets lands on the same side in both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.records import conversation_of
from eaglet.graph.keys import Keys, resolve_stage
from eaglet.params import Params
from eaglet.stages.hidden.spec import Setup

Ref = tuple[int, str]  # (reader index, sample id)


@dataclass(frozen=True)
class States:
    """Where a drafter's hidden states are, resolved: each dataset's directory and, in
    hidden.mode online or hybrid, the hidden stage's setup of the engine that gives them."""

    drafter: str
    paths: dict[str, Path]  # dataset -> its hidden-states directory
    engine: Setup | None = None


def states(params: Params, drafter: str) -> States:
    """The hidden states of the drafter's datasets, as params name them."""
    keys, names = Keys(params), list(params.drafter(drafter)["datasets"])  # weighted: its keys
    paths = {ds: keys.path("hidden", ds) for ds in names}
    online = keys.spec("hidden", names[0]).values.mode != "offline"
    return States(drafter, paths, resolve_stage("hidden", params, names[0])[1] if online else None)


def open_readers(states: States) -> list:
    """A reader for each dataset of the drafter (HiddenReader, or an OnlineReader taking the
    states from the engine in hidden.mode online/hybrid); they must share target and layers.
    Close them with `close_readers`."""
    from eaglet.formats.hidden_store import HiddenReader

    readers = []
    for ds, path in states.paths.items():
        if not path.exists():
            raise EagletError(
                f"drafters.{states.drafter}: hidden states of '{ds}' not built: {path}"
            )
        readers.append(HiddenReader(path))
    check_compatible(readers, list(states.paths))
    if readers[0].manifest.get("mode"):
        from eaglet.stages.hidden.online import online_readers

        return online_readers(states.engine, readers)  # type: ignore[arg-type]
    return readers


def expect(readers: list, refs: Iterator[Ref]) -> None:
    """Tell the readers the order samples will be read in: an online reader fetches ahead."""
    ahead = getattr(readers[0], "expect", None)
    if ahead is not None:
        ahead(refs)


def close_readers(readers: list) -> None:
    """Release the readers (an online reader stops its prefetching and its engine)."""
    for r in readers:
        r.close()


def check_compatible(readers: list, names: list[str]) -> None:
    first = readers[0].manifest
    for name, r in zip(names[1:], readers[1:], strict=True):
        for field in ("target", "aux_layer_ids", "mode"):
            if r.manifest.get(field) != first.get(field):
                raise EagletError(
                    f"hidden states of '{name}' and '{names[0]}' differ in {field}: "
                    f"{r.manifest[field]} != {first[field]}"
                )


def is_heldout(sample_id: str, fraction: float) -> bool:
    """Drawn per conversation: a conversation's samples (`<id>`, `<id>/<k>`) are all held out
    or all trained on."""
    h = hashlib.sha256(f"heldout:{conversation_of(sample_id)}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def split(readers: list, fraction: float) -> tuple[list[Ref], list[Ref]]:
    """(train, held-out) sample references, in reader order."""
    train, held = [], []
    for i, r in enumerate(readers):
        for sid in r.ids:
            (held if is_heldout(sid, fraction) else train).append((i, sid))
    return train, held
