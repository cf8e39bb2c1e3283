"""The trained DFlash drafter's folder, the train stage's artifact for method dflash:
`dflash.json` (the config), `model.safetensors` (fp32, no embeddings) and `metrics.csv`."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglet.atomic import atomic_path, write_text
from eaglet.errors import EagletError
from eaglet.formats.io import read_json, write_json
from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.model import DFlash

DFLASH_CONFIG = "dflash.json"


def is_dflash(folder: Path) -> bool:
    return (Path(folder) / DFLASH_CONFIG).is_file()


def save_dflash(model: DFlash, out: Path, rows: list[dict]) -> None:
    with atomic_path(out, directory=True) as tmp:
        write_json(tmp / DFLASH_CONFIG, model.cfg.to_dict())
        state = {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()}
        del state["embed_tokens.weight"]
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(
            [
                "step",
                "loss",
                "lr",
                "grad_norm",
                *[f"acc_{k}" for k in range(1, model.cfg.block_size)],
            ]
        )
        for r in rows:
            w.writerow(
                [
                    r["step"],
                    f"{r['loss']:.6g}",
                    f"{r['lr']:.6g}",
                    f"{r['grad_norm']:.6g}",
                    *(f"{a:.4f}" for a in r["acc"]),
                ]
            )
        write_text(tmp / "metrics.csv", buf.getvalue())


def load_dflash(folder: Path, embed: torch.Tensor | None = None) -> DFlash:
    """A trained DFlash folder back as the module (fp32), the target's embeddings given apart."""
    model = DFlash(DFlashConfig.from_dict(read_json(Path(folder) / DFLASH_CONFIG)))
    state = load_file(str(Path(folder) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise EagletError(
            f"{folder}: not a DFlash drafter (missing {missing}, unexpected {unexpected})"
        )
    if embed is not None:
        model.embed_tokens.weight.data.copy_(embed)
    return model.eval()
