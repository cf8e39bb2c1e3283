"""The hidden stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglet.device import device_type, resolve_dtype
from eaglet.errors import EagletError
from eaglet.graph.keys import Keys
from eaglet.model.target import TargetSpec, need


@dataclass(frozen=True)
class HiddenSpec:
    """What the hidden states' bytes depend on (and the responses upstream)."""

    target: dict
    max_length: int
    aux_layer_ids: list[int]  # SGLang's convention: outputs of these decoder layers
    compute: dict  # backend, and where eaglet runs the target its device type and dtype
    dtype: str
    storage: dict  # compress, fp8, shard_mb
    mode: str  # offline; online and hybrid write a manifest-only directory


def spec_of(keys: Keys, dataset: str) -> tuple[HiddenSpec, dict]:
    h = keys.params.data["hidden"]
    compute = {"backend": h["backend"]}
    if h["backend"] in ("transformers", "vllm"):  # an operator's vllm: set compute_dtype to its
        compute["device"] = device_type(h["device"])
        compute["dtype"] = resolve_dtype(h["compute_dtype"], h["device"])
    spec = HiddenSpec(
        target=keys.target_identity(),
        max_length=keys.params.max_length(dataset),
        aux_layer_ids=layer_ids(keys, h),
        compute=compute,
        dtype=h["dtype"],
        storage={"compress": h["compress"], "fp8": h["fp8"], "shard_mb": h["shard_mb"]},
        mode=h["mode"],
    )
    return spec, {"responses": keys.key("responses", dataset)}


def default_layer_ids(n_layers: int) -> list[int]:
    """SGLang's default EAGLE-3 aux layers: outputs of layers 1, N//2-1 and N-4 (0-based)."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def layer_ids(keys: Keys, hidden: dict) -> list[int]:
    """The aux layers in SGLang's convention, checked against the target's layer count."""
    text, where, prefix = keys.target_text_config()
    n_layers = need(text, "num_hidden_layers", where, prefix)
    ids = sglang_layer_ids(hidden) or default_layer_ids(n_layers)
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        shift = 1 if hidden["aux_layer_convention"] == "vllm" else 0
        raise EagletError(
            f"{keys.params.path}: hidden.aux_layer_ids: {[i + shift for i in bad]} out of range "
            f"for a target of {n_layers} layers ({where}: {prefix}num_hidden_layers; "
            f"{hidden['aux_layer_convention']} ids: {shift} .. {n_layers - 1 + shift})"
        )
    return list(ids)


def sglang_layer_ids(hidden: dict) -> list[int] | None:
    """`hidden.aux_layer_ids` in SGLang's convention (vLLM ids are SGLang's + 1), or None."""
    ids = hidden.get("aux_layer_ids")
    if ids is None:
        return None
    return [i - 1 for i in ids] if hidden["aux_layer_convention"] == "vllm" else list(ids)


@dataclass(frozen=True)
class Setup:
    """How the stage runs, beside its spec: where things are and how hard to work. Changes no
    byte of the output."""

    out: Path  # where the directory lands
    responses: Path  # the upstream artifact
    target: TargetSpec  # where the target's files are (its identity is in the spec)
    engine: dict  # the hidden-states engine's settings (`hidden.*`, device and dtype resolved)
    source: str  # the params file, for errors
    threads: int | None = None
    quiet: bool = False
