"""The vocab stage's run: the drafter's hidden states opened, the counts taken, the maps
and their sidecar written."""

from __future__ import annotations

from pathlib import Path

from eaglet.formats.io import write_json
from eaglet.formats.vocab import write_vocab
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.stages.hidden.read import States, open_readers, states
from eaglet.stages.vocab.kernel import count_tokens, select
from eaglet.stages.vocab.spec import VocabSpec


def setup(keys: Keys, spec: Spec[VocabSpec]) -> States:
    """Beside the spec: where the drafter's states are."""
    return states(keys.params, spec.name)


def run(spec: Spec[VocabSpec], where: States, out: Path) -> Path:
    """Write the draft vocab `spec` describes, and its sidecar, at `out`."""
    readers = open_readers(where)
    vocab_size = readers[0].manifest["target"]["vocab_size"]
    size = spec.values.draft_vocab_size
    counts = count_tokens(readers, vocab_size)
    d2t, t2d = select(counts, size)
    total = int(counts.sum())
    stats = {
        "draft_vocab_size": size,
        "target_vocab_size": vocab_size,
        "samples": sum(len(r) for r in readers),
        "loss_tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": round(float(counts[t2d].sum()) / total, 6) if total else 0.0,
    }
    write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
    write_vocab(out, d2t, t2d)
    return out
