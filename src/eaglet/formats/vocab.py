"""The draft vocabulary, the vocab stage's artifact: one safetensors file of `d2t` (for each
draft id, the offset to its target id) and `t2d` (for each target id, whether the draft
vocabulary holds it)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglet.atomic import atomic_path


def write_vocab(out: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The vocab file at `out`, written atomically."""
    with atomic_path(out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a vocab artifact."""
    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]
