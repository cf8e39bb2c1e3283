"""Speculative sampling's pieces that an engine runs in place of its own: vLLM's `expand_kernel`
(the per-request temperature written over each request's tokens) in torch, which eaglet's vLLM
plugin (eaglet.engines.vllm_plugin) puts in place of the CPU build's broken stand-in. Sampled
acceptance on vLLM's CPU build is measured through it, so the evaluate stage's kernel holds it.
"""

from __future__ import annotations

import torch


def expand(
    output: torch.Tensor,
    values: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the kernel's launch argument, unused
) -> None:
    """`expand_kernel`: request i's value (replace_from read as replace_to) written over its
    tokens, output[cu[i-1]:cu[i]], in the output's own dtype."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    per_token = values.masked_fill(values == replace_from, replace_to).repeat_interleave(counts)
    output[: per_token.numel()] = per_token.to(output.dtype)
