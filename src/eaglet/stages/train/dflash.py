"""The train stage for method dflash: the drafter's samples (the same responses and stored
hidden states EAGLE-3 reads) through eaglet.model.dflash.train, into a folder of
`dflash.json` (the config), `model.safetensors` (fp32, no embeddings) and `metrics.csv`.

Called by eaglet.stages.train.run when the spec's train settings say method dflash; its
kernel parts are listed in train's CODE."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats.dflash import save_dflash
from eaglet.model import arch
from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.train import Hyper, fit, init
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train.spec import TrainHyper, TrainSpec


def samples(readers: list, refs: list, layers: list[int], max_length: int) -> list[dict]:
    """The training samples cut at max_length, aux narrowed to the drafter's stored layers
    (`layers`: indexes into the store's aux axis, ascending)."""
    out = []
    for i, sid in refs:
        s = readers[i].get(sid)
        n = min(len(s["input_ids"]), max_length)
        out.append(
            {
                "input_ids": s["input_ids"][:n].long(),
                "loss_mask": s["loss_mask"][:n].bool(),
                "aux": s["aux"][:n, layers].float(),
            }
        )
    return out


def check_mask_token(data: list[dict], mask: int, where: str) -> None:
    """The mask token must be one the target never emits: none of its supervised tokens."""
    for s in data:
        if (s["input_ids"][s["loss_mask"]] == mask).any():
            raise EagletError(
                f"{where}.mask_token_id: {mask} is a token the target emits (it is in its "
                "answers); pick a token it never emits"
            )


def hyper(hp: TrainHyper, n: int) -> Hyper:
    """The DFlash trainer's hyperparameters for `n` samples."""
    steps = hp.epochs * math.ceil(n / hp.batch_size)
    if hp.max_steps:
        steps = min(steps, hp.max_steps)
    return Hyper(
        steps=steps,
        lr=hp.lr,
        warmup=max(1, round(hp.warmup_ratio * steps)),
        batch_size=hp.batch_size,
        anchors=hp.dflash.anchors,
        gamma=hp.dflash.gamma,
        grad_clip=hp.max_grad_norm,
        seed=hp.seed,
    )


def run(spec, setup, out: Path, embed, lm_head, d2t) -> dict:
    """Train the DFlash drafter `spec` describes into `out`; the sidecar's stats."""
    where = f"{setup.source}: drafters.{spec.name}.dflash"
    readers = hidden_read.open_readers(setup.states)
    try:
        return train(readers, spec.values, where, out, embed, lm_head, d2t)
    finally:
        hidden_read.close_readers(readers)


def train(readers: list, v: TrainSpec, where: str, out: Path, embed, lm_head, d2t) -> dict:
    """`v`: the train spec's values (train settings with the resolved dflash section, the
    held-out fraction, the resolved layer sizes in arch)."""
    hp = v.hyper
    section = hp.dflash
    torch.manual_seed(hp.seed)
    manifest = readers[0].manifest
    stored = list(manifest["aux_layer_ids"]["sglang"])
    layers = [stored.index(i) for i in section.target_layer_ids]
    train_refs, _ = hidden_read.split(readers, hp.heldout_fraction)
    data = samples(readers, train_refs, layers, hp.max_length)
    check_mask_token(data, section.mask_token_id, where)
    vocab = manifest["target"]["vocab_size"]
    full = len(d2t) >= vocab
    cfg = DFlashConfig(
        vocab_size=vocab,
        draft_vocab_size=vocab if full else len(d2t),
        target_hidden_size=manifest["target"]["hidden_size"],
        num_target_layers=section.num_target_layers,
        target_layer_ids=section.target_layer_ids,
        mask_token_id=section.mask_token_id,
        block_size=section.block_size,
        num_layers=section.num_layers,
        **{k: v.arch[k] for k in arch.FIELDS},
    )
    model = init(cfg, embed.float(), lm_head.float(), None if full else d2t)
    rows = fit(model, data, hyper(hp, len(data)))
    save_dflash(model, out, rows)
    final = rows[-1]["loss"] if rows else None
    return {"samples": len(data), "steps": len(rows), "final_loss": final}
