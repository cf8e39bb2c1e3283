"""The vocab stage: the drafter's draft vocabulary and its maps to and from the target's.

The draft vocabulary is the `draft_vocab_size` most frequent target ids over the loss-masked
(assistant) tokens of the drafter's datasets (ties broken by the smaller id), padded with the
smallest unused ids if fewer occur, sorted ascending. d2t[i] = target_id - i (int64 offsets,
as SGLang and vLLM read them); t2d is a bool mask over the target vocab.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats.io import write_json
from eaglet.formats.vocab import write_vocab
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.stages.drafter_data import States, open_readers, states
from eaglet.stages.vocab_spec import VocabSpec

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.vocab:count_tokens",
        "eaglet.stages.vocab:select",
        "eaglet.stages.drafter_data:open_readers",
    ),
)


def count_tokens(readers: list, vocab_size: int) -> torch.Tensor:
    """How often each target id occurs among the loss-masked tokens of every sample."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for reader in readers:
        # ids and masks alone where the reader gives them (an online reader would prefill)
        for sample in reader.tokens() if hasattr(reader, "tokens") else reader:
            ids = sample["input_ids"][sample["loss_mask"]]
            if ids.numel() and int(ids.max()) >= vocab_size:
                raise EagletError(f"sample {sample['id']}: token id {int(ids.max())} >= vocab")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [V] bool) for the `size` most frequent ids of `counts` [V]."""
    vocab = counts.numel()
    if size > vocab:
        raise EagletError(f"draft_vocab_size {size} exceeds the target vocab ({vocab})")
    order = torch.argsort(-counts, stable=True)  # by count, ties by id
    seen = int((counts > 0).sum())
    chosen = order[: min(size, seen)]
    if len(chosen) < size:  # pad with the smallest ids not chosen
        unused = torch.ones(vocab, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().flatten()[: size - len(chosen)]])
    ids = torch.sort(chosen).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


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
