"""A DFlash training loop over hidden-state samples (the reader contract: input_ids [T],
loss_mask [T], aux [T, n, Ht] of the drafter's target layers in ascending order).

Seeded (anchors and sample order from one generator), AdamW with linear warmup and gradient
clipping, a batch of `batch_size` samples per step padded to the longest. The frozen pieces
are the target's embeddings; lm_head starts from the target's head rows of the draft vocab
(DFlash shares the target's head when it ships none, so this is where its output starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.loss import batch_anchors, block_loss
from eaglet.model.dflash.model import DFlash


@dataclass(frozen=True)
class Hyper:
    steps: int = 100
    lr: float = 1e-3
    warmup: int = 10
    batch_size: int = 4
    anchors: int = 512  # per sample (z-lab's recipe); fewer when the sample has fewer
    gamma: float = 4.0  # loss decay exp(-(k-1)/gamma): 4 for block 8, 7 for 16 (z-lab)
    grad_clip: float = 1.0
    seed: int = 0


def init(cfg: DFlashConfig, embed: Tensor, lm_head: Tensor, d2t: Tensor | None = None) -> DFlash:
    """A fresh drafter on the target's embeddings [V, H] and head [V, H]; d2t [Vd] (offsets,
    as eaglet's vocab stage writes them) when the draft vocab is reduced."""
    model = DFlash(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        if d2t is not None:
            model.d2t.copy_(d2t)
            model.t2d.zero_()
            model.t2d[model.to_target(torch.arange(cfg.draft_vocab_size))] = True
        model.lm_head.weight.copy_(lm_head[model.to_target(torch.arange(cfg.draft_vocab_size))])
    return model


def collate(samples: Sequence[dict]) -> tuple[Tensor, Tensor, Tensor]:
    """(aux [B, T, n, Ht], input_ids [B, T], loss_mask [B, T]) padded with zeros / False."""
    t = max(len(s["input_ids"]) for s in samples)
    first = samples[0]["aux"]
    aux = first.new_zeros((len(samples), t, *first.shape[1:]), dtype=torch.float32)
    ids = torch.zeros((len(samples), t), dtype=torch.long)
    mask = torch.zeros((len(samples), t), dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        aux[i, :n] = s["aux"].float()
        ids[i, :n] = s["input_ids"]
        mask[i, :n] = s["loss_mask"].bool()
    return aux, ids, mask


def fit(model: DFlash, samples: Sequence[dict], hp: Hyper) -> list[dict]:
    """Train `model` in place; one row per step (loss, lr, accuracy per slot)."""
    g = torch.Generator().manual_seed(hp.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows, order = [], []
    model.train()
    for step in range(hp.steps):
        if len(order) < hp.batch_size:
            order += torch.randperm(len(samples), generator=g).tolist()
        batch, order = [samples[i] for i in order[: hp.batch_size]], order[hp.batch_size :]
        aux, ids, mask = collate(batch)
        anchors = batch_anchors(mask, hp.anchors, g)
        lr = hp.lr * min(1.0, (step + 1) / max(hp.warmup, 1))
        for group in opt.param_groups:
            group["lr"] = lr
        out = block_loss(model, aux, ids, mask, anchors, hp.gamma)
        opt.zero_grad()
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        acc = (out.correct.float() / out.counted.clamp(min=1)).tolist()[1:]
        rows.append(
            {"step": step, "loss": out.loss.item(), "lr": lr, "grad_norm": norm.item(), "acc": acc}
        )
    model.eval()
    return rows
