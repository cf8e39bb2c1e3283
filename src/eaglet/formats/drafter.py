"""The trained EAGLE-3 drafter's folder, the train stage's artifact (config.json of
DrafterConfig, model.safetensors, metrics.csv, heldout.csv): written by train, read by evaluate,
export and warm start. Method dflash's folder: eaglet.formats.dflash."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from safetensors.torch import load_file, save_file

from eaglet.atomic import atomic_path, write_text
from eaglet.formats.io import read_json, write_json
from eaglet.model.drafter import Drafter, DrafterConfig


def _csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def save_drafter(model: Drafter, out: Path, rows: list[dict], held_rows: list[dict]) -> None:
    """The trained drafter folder, written atomically."""
    with atomic_path(out, directory=True) as tmp:
        tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"))
        write_json(tmp / "config.json", model.cfg.to_dict())
        write_text(tmp / "metrics.csv", _csv(rows))
        write_text(tmp / "heldout.csv", _csv(held_rows))


def load_drafter(folder: str | Path, device: str = "cpu") -> Drafter:
    """A trained drafter from its folder (model.safetensors + config.json)."""
    folder = Path(folder)
    model = Drafter(DrafterConfig.from_dict(read_json(folder / "config.json")))
    model.load_state_dict(load_file(str(folder / "model.safetensors"), device=device))
    return model.to(device).eval()
