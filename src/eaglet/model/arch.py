"""The drafter's architecture: `drafters.<d>.arch` resolved against the target's text config.

Pure JSON (no torch, no transformers): the train key holds the resolved values. A field left
out of `arch` takes its default from the target:

- Llama-like targets (GQA/MHA attention): the target layer's own sizes, as EAGLE-3 always did.
- MLA targets (DeepSeek-V3, Kimi-K2/K2.5: `kv_lora_rank` in the config): a plain Llama layer of
  the published Kimi drafters' shape: the target's head count with heads of width
  `qk_nope_head_dim` (128; transformers' `head_dim` for MLA is `qk_rope_head_dim`, 64), as many
  kv heads, the dense MLP's `intermediate_size`.

RoPE (`rope_theta`, `rope_scaling`) is the target's in both cases, YaRN included; `rope_scaling:
null` in `arch` turns scaling off. The hidden size is always the target's: the drafter reads the
target's frozen embeddings, and SGLang shares them.

EAGLE-3.1's options (NORMS: `fc_norm`, `norm_before_fc`, `norm_before_residual`, `norm_output`;
eaglet.model.drafter shows their math) are false unless `arch` sets them, whatever the target.
The resolved arch holds only those set true, so a drafter without them keeps the key (and the
bytes) it had before they existed.
"""

from __future__ import annotations

from typing import Any

from eaglet.errors import EagletError
from eaglet.model.target import need

FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
)
NORMS = ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output")
SCALING_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)


def is_mla(text: dict) -> bool:
    return text.get("kv_lora_rank") is not None


def rope(text: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling) of a config in either of transformers' layouts: flat
    `rope_theta` + `rope_scaling` (config.json as published), or `rope_parameters` (v5)."""
    params = text.get("rope_parameters") or {}
    theta = text.get("rope_theta", params.get("rope_theta"))
    scaling = text.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **{k: scaling[k] for k in SCALING_KEYS if k in scaling}}


def check_scaling(scaling: dict | None, where: str, prefix: str) -> None:
    """The target's RoPE scaling must be one the drafter implements (YaRN), or be turned off."""
    if scaling is None:
        return
    if scaling["rope_type"] != "yarn":
        raise EagletError(
            f"{where}: {prefix}rope_scaling: '{scaling['rope_type']}' is not implemented by "
            "eaglet's drafter (yarn is); set drafters.<name>.arch.rope_scaling (null: plain RoPE)"
        )
    for k in ("factor", "original_max_position_embeddings"):
        need(scaling, k, where, f"{prefix}rope_scaling.")


def target_defaults(text: dict, where: str, prefix: str = "") -> dict:
    """The drafter architecture a target implies (see the module doc)."""

    def field(name: str) -> Any:
        return need(text, name, where, prefix)

    hidden, heads = field("hidden_size"), field("num_attention_heads")
    if is_mla(text):
        head_dim = text.get("qk_nope_head_dim") or field("v_head_dim")
    else:
        head_dim = text.get("head_dim") or hidden // heads
    theta, scaling = rope(text)
    return {
        "hidden_size": hidden,
        "intermediate_size": field("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(field("rms_norm_eps")),
        "rope_theta": float(need({"rope_theta": theta}, "rope_theta", where, prefix)),
        "rope_scaling": scaling,
        "max_position_embeddings": field("max_position_embeddings"),
    }


def resolve(text: dict, arch: dict, where: str, prefix: str = "") -> dict:
    """The drafter's architecture: `arch` (params) over the target's defaults, every field set,
    and the EAGLE-3.1 options set true."""
    out = target_defaults(text, where, prefix) | {k: v for k, v in arch.items() if k in FIELDS}
    out |= {k: True for k in NORMS if arch.get(k)}
    if "rope_scaling" not in arch:
        check_scaling(out["rope_scaling"], where, prefix)
    elif arch["rope_scaling"] is not None:  # the schema checked it
        out["rope_scaling"] = {"rope_type": "yarn", **arch["rope_scaling"]}
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise EagletError(
            f"drafter arch: num_attention_heads {out['num_attention_heads']} is not a multiple "
            f"of num_key_value_heads {out['num_key_value_heads']}"
        )
    return out


def differs(text: dict, resolved: dict) -> dict:
    """The target's value of every field where the drafter's differs (None: the target has no
    such field, e.g. `head_dim` of an MLA model)."""
    theta, scaling = rope(text)
    target = {f: text.get(f) for f in FIELDS} | {"rope_theta": theta, "rope_scaling": scaling}
    heads = target["num_attention_heads"]
    target["num_key_value_heads"] = target["num_key_value_heads"] or heads
    if target["head_dim"] is None and not is_mla(text) and heads:
        target["head_dim"] = target["hidden_size"] // heads  # Llama's implicit head size
    return {f: target[f] for f in FIELDS if target[f] != resolved[f]}
