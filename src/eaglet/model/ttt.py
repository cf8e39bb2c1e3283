"""The test-time-training (TTT) chain that train and evaluate share: a batch of samples from
hidden-state readers (`load`, `collate`), the per-step masks, the scorer, one training process's
device and precision (`Run`), the chained drafts and their accepted counts."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglet.device import resolve_dtype
from eaglet.model import target_head
from eaglet.model.drafter import Drafter, Score, recomputed
from eaglet.model.target import pick_device
from eaglet.model.target_head import TargetHead, shift


def step_masks(loss_mask: Tensor, in_vocab: Tensor, steps: int) -> list[Tensor]:
    """Where TTT step k is trained: token t+k+2 is an assistant token and the target's argmax
    for it (at t+k+1) is in the draft vocab."""
    return [shift(loss_mask, k + 2) & shift(in_vocab, k + 1) for k in range(steps)]


def at(x: Tensor, mask: Tensor, n: int) -> Tensor:
    """x[b, t + n] for every (b, t) where mask holds; mask must be False for t >= T - n."""
    return x[:, n:][mask[:, : x.shape[1] - n]]


def scorer(model: Drafter, masks: list[Tensor], last: Tensor, head: TargetHead) -> Score:
    """score(k, states, start) for Drafter.forward: the summed soft cross-entropy and the count
    of top-1 hits of TTT step k at positions start.. (its states [B, c, H] there), over the
    positions of masks[k]; the target's distribution comes from last [B, T, Ht] one position on.

    Positions go in chunks of at most LOGITS logits (target_head), each forming its logits and
    p, using and dropping them; under autograd, when there is more than one chunk, a chunk is
    recomputed in backward rather than kept, so memory does not grow with the draft vocab. When
    every position read fits one chunk, p is formed once for them all and shared by the steps."""
    rows = max(1, target_head.LOGITS // len(head.draft))
    flat = last.flatten(0, 1)
    index = torch.arange(len(flat), device=last.device).view(last.shape[:2])
    read = torch.cat([at(index, mk, k + 1) for k, mk in enumerate(masks)]).unique()
    p_read = slot = None
    if len(read) <= rows:  # a short batch: p formed once for every position read, shared
        slot = torch.zeros(len(flat), dtype=torch.long, device=last.device)
        slot[read] = torch.arange(len(read), device=last.device)
        p_read = head.p(flat[read])

    def sums(state: Tensor, where: Tensor) -> tuple[Tensor, Tensor]:
        logits = model.logits(state).float()
        p = head.p(flat[where]) if p_read is None else p_read[slot[where]]
        return -(p * F.log_softmax(logits, dim=-1)).sum(), (logits.argmax(-1) == p.argmax(-1)).sum()

    def score(k: int, states: Tensor, start: int) -> tuple[Tensor, Tensor]:
        span = slice(start, start + states.shape[1])
        mask = masks[k][:, span]
        where = (index[:, span] + k + 1)[mask]  # p of token t+k+2 sits at t+k+1
        chunks = list(zip(states[mask].split(rows), where.split(rows), strict=True))
        parts = [recomputed(sums, *c) if len(chunks) > 1 else sums(*c) for c in chunks]
        # an empty step: one empty chunk
        return torch.stack([c for c, _ in parts]).sum(), torch.stack([h for _, h in parts]).sum()

    return score


class Run:
    """Process group, device and precision of one training process."""

    def __init__(self, dtype: str, device: str = "auto"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        cuda = pick_device(device).startswith("cuda")
        self.device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.dtype = resolve_dtype(dtype, self.device.type)

    def autocast(self):
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.dtype))

    def sum(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def prepare(batch: dict, head: TargetHead, steps: int, device, refs: list) -> dict:
    """Add the per-step masks (on the device) to the batch of samples `refs`; its hidden
    states stay where they are until `ttt_batch` needs them."""
    batch = batch | {k: batch[k].to(device) for k in ("input_ids", "loss_mask")}
    lm = batch["loss_mask"]
    in_vocab = head(batch["last"], shift(lm, 1), refs)  # p[t]: learnt where t+1 is an answer
    return batch | {"masks": step_masks(lm, in_vocab, steps)}


def ttt_batch(model, b: dict, steps: int, head: TargetHead, run: Run) -> tuple[Tensor, Tensor]:
    """Per step (summed soft cross-entropy, top-1 hits) of the prepared batch b; `model` is the
    drafter or its DDP wrapper. Its aux states go to the device in the compute dtype (what
    autocast casts them to anyway), the final states in fp32."""
    aux = b["aux"].to(run.device, getattr(torch, run.dtype))
    drafter = model.module if isinstance(model, DDP) else model
    with run.autocast():
        score = scorer(drafter, b["masks"], b["last"].to(run.device), head)
        ce, hits = model(aux, b["input_ids"], steps, score)
    return ce, hits.float()


def chain_accepted(model: Drafter, b: dict, steps: int, head: TargetHead, run: Run) -> Tensor:
    """Per start position of the prepared batch b (token t+1 and t+2 are answer tokens): how
    many of `steps` chained drafts from t are accepted, each equal to the target's argmax
    (teacher-forced over the stored states, as greedy chain decoding of the target's own
    answers sees them). Positions and logits go in chunks, as in training."""
    masks, last, lm = b["masks"], b["last"].to(run.device), b["loss_mask"]
    hits = torch.zeros((steps, *lm.shape), dtype=torch.bool, device=run.device)
    flat = last.flatten(0, 1)
    index = torch.arange(len(flat), device=run.device).view(last.shape[:2])
    rows = max(1, target_head.LOGITS // len(head.draft))
    zero = torch.zeros((), device=run.device)

    def score(k: int, states: Tensor, start: int) -> tuple[Tensor, Tensor]:
        span = slice(start, start + states.shape[1])
        mask = masks[k][:, span]
        where = (index[:, span] + k + 1)[mask]  # the target's next token after draft k
        same = [
            model.logits(s).float().argmax(-1) == head.p(flat[w]).argmax(-1)
            for s, w in zip(states[mask].split(rows), where.split(rows), strict=True)
        ]
        hits[k, :, span][mask] = torch.cat(same)
        return zero, zero

    aux = b["aux"].to(run.device, getattr(torch, run.dtype))
    with torch.no_grad(), run.autocast():
        model(aux, b["input_ids"], steps, score)
    chain = torch.ones_like(lm)
    count = torch.zeros(lm.shape, dtype=torch.long, device=run.device)
    for k in range(steps):
        chain = chain & hits[k]
        count += chain
    return count[shift(lm, 1) & shift(lm, 2)].cpu()


def accepted_counts(
    model: Drafter, readers, refs, head: TargetHead, steps: int, run: Run, batch: int, length: int
) -> Tensor:
    """chain_accepted over the samples `refs`, `batch` samples at a time, each cut at `length`
    tokens: one count per answer start position."""
    counts = []
    for i in range(0, len(refs), batch):
        part = refs[i : i + batch]
        b = prepare(load(readers, part, length), head, steps, run.device, part)
        counts.append(chain_accepted(model, b, steps, head, run))
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long)


def collate(samples: list[dict], max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad samples (cut at max_length) into a batch; padding is outside the loss mask."""
    t = min(max(len(s["input_ids"]) for s in samples), max_length)
    b, h = len(samples), samples[0]["last"].shape[-1]
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "aux": torch.zeros(b, t, 3, h, dtype=torch.float32),
        "last": torch.zeros(b, t, h, dtype=torch.float32),
    }
    for i, s in enumerate(samples):
        n = min(len(s["input_ids"]), t)
        for name in batch:
            batch[name][i, :n] = s[name][:n]
    return batch


def load(readers: list, refs: list[tuple[int, str]], max_length: int) -> dict[str, torch.Tensor]:
    return collate([readers[i].get(sid) for i, sid in refs], max_length)
