"""The drafter's architecture: `drafters.<d>.arch` resolved against the target's text config.

Pure JSON (no torch, no transformers): the train key holds the resolved values. A field left
out of `arch` takes its default from the target:

- Llama-like targets (GQA/MHA attention): the target layer's own sizes, as EAGLE-3 always did.
- MLA targets (DeepSeek-V3, Kimi-K2/K2.5: `kv_lora_rank` in the config): a plain Llama layer of
  the published Llama Kimi drafters' shape (AQ-MedAI's, lightseekorg's kimi-k2.5-eagle3): the
  target's head count with heads of width `qk_nope_head_dim` (128; transformers' `head_dim` for
  MLA is `qk_rope_head_dim`, 64), as many kv heads, the dense MLP's `intermediate_size`; or,
  with `attention: mla`, an MLA layer (below).

RoPE (`rope_theta`, `rope_scaling`) is the target's in both cases, YaRN included; `rope_scaling:
null` in `arch` turns scaling off. The hidden size is always the target's: the drafter reads the
target's frozen embeddings, and SGLang shares them.

EAGLE-3.1's options (NORMS: `fc_norm`, `norm_before_fc`, `norm_before_residual`, `norm_output`;
eaglet.model.drafter shows their math) are false unless `arch` sets them, whatever the target.
The resolved arch holds only those set true, so a drafter without them keeps the key (and the
bytes) it had before they existed.

`attention: mla` (MLA targets only) makes the layer's attention DeepSeek-V3's multi-head latent
attention, as lightseekorg's `*-eagle3-mla` Kimi drafters have it (vLLM and SGLang serve it as
`Eagle3DeepseekV2ForCausalLM`): its sizes (MLA: `q_lora_rank`, null for a plain q_proj,
`kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`) are the target's unless
`arch` sets them, with the target's head count. An MLA layer has no kv heads of its own width:
`num_key_value_heads` resolves to the head count and `head_dim` to the query/key head width
(qk_nope_head_dim + qk_rope_head_dim), and `arch` may not set either. Like the norms, `attention`
and the MLA sizes are in the resolved arch only under `attention: mla`: a Llama layer's key and
bytes are those of before the option existed.
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
MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
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
    if arch.get("attention", "llama") == "mla":
        out |= mla(text, arch, out["num_attention_heads"], where, prefix)
    elif set(MLA) & set(arch):
        raise EagletError(
            f"drafter arch: {', '.join(f for f in MLA if f in arch)}: MLA sizes need attention: mla"
        )
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


def mla(text: dict, arch: dict, heads: int, where: str, prefix: str) -> dict:
    """The resolved fields of an MLA layer (`attention: mla`): the target's MLA sizes under
    `arch`'s, its kv heads and head_dim implied (see the module doc)."""
    if not is_mla(text):
        raise EagletError(
            f"drafter arch: attention: mla needs an MLA target (kv_lora_rank in its config); "
            f"{where} has none: use attention: llama"
        )
    fixed = [f for f in ("num_key_value_heads", "head_dim") if f in arch]
    if fixed:
        raise EagletError(
            f"drafter arch: {' and '.join(fixed)}: an MLA layer has none of its own (set "
            "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)"
        )
    sizes = {f: text.get(f) for f in MLA} | {f: arch[f] for f in MLA if f in arch}
    for f in MLA[1:]:  # q_lora_rank may be null: q_proj reads the input directly
        need(sizes, f, where, prefix)
    if sizes["qk_rope_head_dim"] % 2:
        raise EagletError(f"drafter arch: qk_rope_head_dim {sizes['qk_rope_head_dim']} is odd")
    return {
        "attention": "mla",
        **sizes,
        "num_key_value_heads": heads,
        "head_dim": sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
    }


def differs(text: dict, resolved: dict) -> dict:
    """The target's value of every field where the drafter's differs (None: the target has no
    such field, e.g. `head_dim` of an MLA model)."""
    theta, scaling = rope(text)
    target = {f: text.get(f) for f in FIELDS} | {"rope_theta": theta, "rope_scaling": scaling}
    heads = target["num_attention_heads"]
    target["num_key_value_heads"] = target["num_key_value_heads"] or heads
    if target["head_dim"] is None and not is_mla(text) and heads:
        target["head_dim"] = target["hidden_size"] // heads  # Llama's implicit head size
    fields = FIELDS
    if resolved.get("attention") == "mla":  # head_dim is implied; the MLA sizes are compared
        fields = (*(f for f in FIELDS if f != "head_dim"), *MLA)
        target |= {f: text.get(f) for f in MLA}
    return {f: target[f] for f in fields if target[f] != resolved[f]}


def served_rope_scaling(rope_scaling: dict | None) -> dict | None:
    """rope_scaling as an export's config.json writes it: both spellings of the kind, since
    engines and transformers versions read one or the other."""
    if rope_scaling is None:
        return None
    return {**rope_scaling, "type": rope_scaling["rope_type"]}
