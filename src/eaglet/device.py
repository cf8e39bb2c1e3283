"""`device: auto` and `dtype: auto` made concrete, once, for both the keys and the run.

Resolution never imports torch (keys are computed at every Snakefile parse): `auto` is cuda
where an NVIDIA driver is loaded and CUDA_VISIBLE_DEVICES does not hide every device, else cpu;
`dtype: auto` is bfloat16 on cuda and float32 elsewhere. Keys hold these resolved values, so a
CPU fp32 build and a GPU bf16 build never share a key, and `auto` keys like what it resolves to.
"""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def resolve_device(device: str) -> str:
    """The device `device` names on this machine: `auto` resolved, anything else as given."""
    if device != "auto":
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    return "cuda" if NVIDIA_DRIVER.exists() else "cpu"


def device_type(device: str) -> str:
    """What a key records of a device: its type (cuda:0 and cuda:1 compute the same bytes)."""
    return resolve_device(device).split(":")[0]


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype: `auto` is bfloat16 on cuda, float32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type(device) == "cuda" else "float32"
