"""What the target's hidden states are, whichever engine captures them: the pure pieces the
engines call, so that the hidden stage's kernel holds them and no engine code.

vLLM (`eaglet.engines.vllm.hidden.VLLMHidden`) is asked for the layers `vllm_layers` names
(SGLang id + 1, and N, the final layer, stored before the final norm) and reads each back at its
position; `rms_norm` is the target's final norm applied to that last slot. transformers
(`eaglet.engines.transformers.TransformersHidden`) runs `right_padded` batches and cuts each
sequence's states out with `unbatched`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def vllm_layers(layer_ids: list[int], n_layers: int) -> tuple[list[int], list[int], int]:
    """(the vLLM layer ids to request, sorted; the position of each aux layer among them; the
    position of the final layer N): vLLM's layer i + 1 is SGLang's (and eaglet's) layer i."""
    vllm_ids = sorted({i + 1 for i in layer_ids} | {n_layers})
    return vllm_ids, [vllm_ids.index(i + 1) for i in layer_ids], vllm_ids.index(n_layers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final norm, as transformers' LlamaRMSNorm computes it (fp32 inside)."""
    import torch

    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def right_padded(batch: list[list[int]]) -> torch.Tensor:
    """The batch's token ids, right-padded with 0: under causal attention a real token never
    sees the padding after it, so no attention mask is needed."""
    import torch

    width = max(len(s) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
    return ids


def unbatched(
    aux: list[torch.Tensor], last: torch.Tensor, batch: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's (aux states [T, L, H], stacked in `aux`'s layer order; last states
    [T, H]) out of a right-padded batch's [B, W, H] outputs."""
    import torch

    stacked = torch.stack(aux, dim=2).cpu()
    last = last.cpu()
    return [(stacked[i, : len(s)], last[i, : len(s)]) for i, s in enumerate(batch)]
