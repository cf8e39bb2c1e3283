"""The target's frozen lm_head as training reads it: the target's next-token distribution over
the draft vocab, and whether its argmax is a draft id, from the stored final states.

Positions and rows go in chunks of at most LOGITS logits, so nothing per token grows with the
vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

Ref = tuple[int, str]  # a sample: (reader index, sample id)


def shift(x: Tensor, n: int) -> Tensor:
    """x[:, t + n] at position t, zero (False) past the end; x is [B, T, ...]."""
    pad = torch.zeros_like(x[:, : min(n, x.shape[1])])
    return torch.cat([x[:, n:], pad], dim=1)


LOGITS = 2**23  # logits held at once by the loss and the argmax check (fp32: 32 MiB)


class TargetHead:
    """The target's frozen lm_head, split into the draft-vocab rows (fp32, for the target
    distribution p, formed per chunk of positions from the stored final states) and the others
    (in `dtype`, only to tell whether the argmax is a draft id).

    Whether the argmax is a draft id depends on the sample alone, and costs a product with
    every non-draft row (11x the draft rows at the demo's 4,096 of 49,152): it is computed once
    per sample, in chunks of rows, and kept, not once per epoch."""

    def __init__(self, lm_head: Tensor, t2d: Tensor, dtype: torch.dtype = torch.float32):
        self.draft = lm_head[t2d].float()
        self.rest = lm_head[~t2d].to(dtype)
        self.known: dict[Ref, Tensor] = {}  # sample -> its in_vocab row

    def to(self, device) -> TargetHead:
        self.draft, self.rest = self.draft.to(device), self.rest.to(device)
        return self

    def p(self, last: Tensor) -> Tensor:
        """The target's softmax over the draft vocab at final states last [N, H], in fp32."""
        with torch.autocast(last.device.type, enabled=False):
            return torch.softmax(last.float() @ self.draft.T, dim=-1)

    def __call__(self, last: Tensor, need: Tensor, refs: list[Ref]) -> Tensor:
        """in_vocab [B, T]: at the positions of `need` of the samples `refs` (final states
        `last`, on any device), whether the target's argmax over the full vocab is a draft id."""
        new = [i for i, ref in enumerate(refs) if ref not in self.known]
        if new:  # the batch's unseen samples, together
            rows = torch.cat([last[i][need[i].to(last.device)] for i in new])
            hits = self.argmax_in_draft(rows.to(need.device)).split(
                [int(need[i].sum()) for i in new]
            )
            for i, hit in zip(new, hits, strict=True):
                known = torch.zeros_like(need[i])
                known[need[i]] = hit
                self.known[refs[i]] = known  # False past the sample's end, so any width fits
        in_vocab = torch.zeros_like(need)
        for i, ref in enumerate(refs):
            known = self.known[ref][: need.shape[1]]
            in_vocab[i, : len(known)] = known
        return in_vocab

    def argmax_in_draft(self, rows: Tensor) -> Tensor:
        """Whether the target's argmax is a draft id, for final states rows [N, H], in chunks
        of at most LOGITS logits."""
        if not self.rest.numel():
            return torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        n = max(1, LOGITS // (len(self.draft) + len(self.rest)))
        out = []
        for chunk in rows.float().split(n):
            best = (chunk @ self.draft.T).max(-1).values
            out.append(best >= (chunk.to(self.rest.dtype) @ self.rest.T).max(-1).values.float())
        return torch.cat(out)  # no rows: one empty chunk
