"""DFlash's training objective: anchors, blocks and the decayed cross-entropy.

An anchor is a position a where x_a and x_{a+1} are both supervised (assistant tokens): the
target produced x_a, and the block's first mask has a label worth learning. Up to
`anchors` of them per sample are drawn without replacement from a seeded generator (a sample
with none contributes nothing). Slot k of the block at a (k = 1..S-1) is scored by
cross-entropy against the stored token x_{a+k}, where a+k < T and x_{a+k} is supervised and in
the draft vocabulary, weighted exp(-(k-1)/gamma): early slots decide acceptance, since a
rejected slot ends the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from eaglet.model.dflash.model import DFlash


def candidate_anchors(loss_mask: Tensor) -> Tensor:
    """[N] long: positions a >= 1 with loss_mask[a] and loss_mask[a+1] (a + 1 < T). a >= 1: a
    block needs at least one context state before it, as serving always has the prompt's."""
    ok = loss_mask[:-1].bool() & loss_mask[1:].bool()
    ok[0] = False
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """Up to n anchors of one sample, drawn without replacement, ascending."""
    cands = candidate_anchors(loss_mask)
    pick = torch.randperm(len(cands), generator=generator)[:n]
    return cands[pick].sort().values


def batch_anchors(loss_masks: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """[B, A] anchors of a padded batch (A = the most any sample has, at most n), -1 pads."""
    rows = [sample_anchors(m, n, generator) for m in loss_masks.cpu()]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out.to(loss_masks.device)


def block_labels(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """(labels, valid) [B, A, S] in target ids: x_{a+k} at slot k, valid where k >= 1, the
    anchor is real, a + k < T and x_{a+k} is supervised."""
    b, t = input_ids.shape
    where = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # [B, A, S]
    inside = (anchors[..., None] >= 0) & (where < t)
    where = where.clamp(0, t - 1)
    flat = where.reshape(b, -1)
    labels = input_ids.gather(1, flat).view_as(where)
    supervised = loss_mask.bool().gather(1, flat).view_as(where)
    valid = inside & supervised
    valid[..., 0] = False  # the anchor slot holds a known token
    return labels, valid


def decay_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """[S]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass(frozen=True)
class BlockLoss:
    loss: Tensor  # the weighted mean cross-entropy (differentiable)
    weight: Tensor  # the sum of weights behind it (to sum over a batch or accumulation)
    correct: Tensor  # [S] top-1 hits per slot
    counted: Tensor  # [S] scored positions per slot


def block_loss(
    model: DFlash,
    aux: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    gamma: float,
) -> BlockLoss:
    """The decayed cross-entropy of the blocks at `anchors` against the stored tokens."""
    s = model.cfg.block_size
    labels, valid = block_labels(input_ids, loss_mask, anchors, s)
    draft = model.target_to_draft()[labels]  # -1 where the draft vocab lacks the token
    valid = valid & (draft >= 0)
    logits = model(aux, input_ids, anchors)  # [B, A, S, Vd]
    w = decay_weights(s, gamma, logits.device).expand_as(valid) * valid
    ce = F.cross_entropy(
        logits.float().flatten(0, 2), draft.clamp(min=0).flatten(), reduction="none"
    ).view_as(w)
    total = w.sum()
    loss = (ce * w).sum() / total.clamp(min=1e-9)
    hit = (logits.argmax(-1) == draft) & valid
    return BlockLoss(loss, total, hit.sum((0, 1)), valid.sum((0, 1)))


def acceptance_length(correct_prefix: Tensor) -> float:
    """1 + the mean number of leading slots right per block (the bonus token included), from
    [blocks, S-1] bools: the offline estimate of what a greedy engine would accept."""
    if correct_prefix.numel() == 0:
        return math.nan
    return 1.0 + correct_prefix.int().cumprod(-1).sum(-1).float().mean().item()
