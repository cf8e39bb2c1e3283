"""What decides the draft vocabulary's bytes: token counts over the loss-masked tokens, and the
most frequent ids chosen from them."""

from __future__ import annotations

import torch

from eaglet.errors import EagletError


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
