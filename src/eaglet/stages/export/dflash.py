"""The sglang and vllm stages for method dflash: one folder in z-lab's layout
(eaglet.formats.dflash_export), which both engines read, validated by loading it back.

Called by eaglet.stages.export.run when the trained folder is a DFlash drafter."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import torch

from eaglet.atomic import atomic_path
from eaglet.errors import EagletError
from eaglet.formats import dflash_export
from eaglet.formats.dflash import load_dflash
from eaglet.formats.io import write_json
from eaglet.graph.keys import sidecar_of
from eaglet.model.dflash.model import DFlash

BF16_TOLERANCE = 0.1  # the export's bf16 weights against the trained fp32 ones, on a probe


def serve_command(fmt: str, target: str, draft: str, block_size: int) -> str:
    """The engine's launch command: block_size - 1 drafts a round (the anchor is the target's)."""
    if fmt == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
            "--speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {shlex.quote(draft)} "
            f"--speculative-dflash-block-size {block_size}"
        )
    spec = json.dumps(
        {"method": "dflash", "model": draft, "num_speculative_tokens": block_size - 1},
        separators=(",", ":"),
    )
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def probe(model: DFlash, seed: int = 0) -> torch.Tensor:
    """Block logits over a random sample (random embeddings: the export ships none)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    t = 16
    aux = torch.randn(1, t, len(cfg.target_layer_ids), cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
    with torch.no_grad():
        return model(aux, ids, torch.tensor([[1, 6, 11]]))


def validate(folder: Path, reference: DFlash) -> dict:
    """Load the export back (config, every tensor) and compare its logits with the trained
    drafter's on a probe; a one-line error if they differ beyond bf16 rounding."""
    embed = torch.randn(reference.cfg.vocab_size, reference.cfg.hidden_size)
    reference.embed_tokens.weight.data.copy_(embed)
    loaded = dflash_export.load(folder, embed)
    if loaded.cfg != reference.cfg:
        raise EagletError(f"{folder}: config.json does not round-trip the trained config")
    diff = (probe(loaded) - probe(reference)).abs().max().item()
    if not diff < BF16_TOLERANCE:
        raise EagletError(
            f"{folder}: the export's logits differ from the trained drafter's by {diff:.3g}"
        )
    return {"format": "dflash", "max_abs_logit_diff_vs_fp32": diff}


def run(spec, setup, out: Path) -> tuple[Path, str]:
    model = load_dflash(setup.trained)
    v = spec.values
    draft = os.path.relpath(out.resolve(), setup.root.resolve())
    command = serve_command(v.format, v.verifier, draft, model.cfg.block_size)
    with atomic_path(out, directory=True) as tmp:
        dflash_export.write(model, tmp)
        report = validate(tmp, model)
        write_json(
            sidecar_of(out), {"provenance": spec.provenance(), "stats": report | {"serve": command}}
        )
    return out, command
