"""Warm start: a drafter trained elsewhere as the starting point of this run's training.

`drafters.<d>.train.init_from` names a drafter folder in any of the three shapes drafters come
in: eaglet's own train output (config.json of DrafterConfig + model.safetensors), a speculators
export (what vLLM serves; `speculators_model_type: eagle3`) or an SGLang/SpecForge one
(`LlamaForCausalLMEagle3`). The folder's bytes (config.json and model.safetensors) are in the
train key, never its path.

Every tensor of the decoder layer, the fusion and the norms is copied; their shapes must match
this run's (the same target width, aux layers and layer shape). The draft vocabulary may differ:
a row of lm_head is copied where its target token is in both draft vocabularies, and the rest
keep this run's seeded initialisation. The embeddings stay the target's (frozen), d2t and t2d
this run's vocab.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import read_json
from eaglet.model.drafter import Drafter, DrafterConfig

OWN = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")  # this run's, or mapped


def read(folder: Path, embed: torch.Tensor) -> tuple[str, Drafter]:
    """(format, drafter) of a folder in any of the three shapes; `embed` are the target's
    embeddings (an SGLang export has none)."""
    config = read_json(folder / "config.json")
    if "draft_vocab_size" in config and "aux_layer_ids" in config:  # eaglet's DrafterConfig
        try:
            return "eaglet", load_drafter(folder)
        except (TypeError, RuntimeError) as e:  # unknown fields, tensors that do not fit
            raise EagletError(
                f"{folder}: not an eaglet drafter: {str(e).splitlines()[0]}"
            ) from None
    return exports.load_export(folder, embed)


def check(cfg: DrafterConfig, source: Drafter, where: str) -> None:
    """A one-line error naming every field where `source`'s shape is not this run's (the draft
    vocabulary's size may differ)."""
    mine, theirs = asdict(cfg), asdict(source.cfg)
    differ = [
        f"{k} {mine[k]} here, {theirs[k]} in the folder"
        for k in mine
        if k != "draft_vocab_size" and mine[k] != theirs[k]
    ]
    if differ:
        raise EagletError(f"{where}: another drafter shape: {'; '.join(differ)}")


def start_from(model: Drafter, source: Drafter) -> dict:
    """Copy `source`'s weights into the freshly initialised `model` (its vocab maps set):
    every shared tensor, and the lm_head rows of tokens both draft vocabularies hold. Returns
    what was copied."""
    check(model.cfg, source, "train.init_from")
    src, dst = source.state_dict(), model.state_dict()
    with torch.no_grad():
        for name, t in dst.items():
            if name not in OWN:
                t.copy_(src[name])
        here = torch.arange(model.cfg.draft_vocab_size) + model.d2t  # target id of each row
        there = torch.arange(source.cfg.draft_vocab_size) + source.d2t
        row_of = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long)
        row_of[there] = torch.arange(len(there))
        shared = row_of[here] >= 0
        model.lm_head.weight[shared] = source.lm_head.weight[row_of[here][shared]].to(
            model.lm_head.weight.dtype
        )
    return {
        "rows_copied": int(shared.sum()),
        "draft_vocab": model.cfg.draft_vocab_size,
        "source_draft_vocab": source.cfg.draft_vocab_size,
    }
