"""The export folders, the sglang and vllm stages' artifacts: a trained drafter as an SGLang draft
folder or a speculators (vLLM) one, written here and read back from its files alone (`load_export`,
what the export's validator and a warm start read).

sglang: config.json with architectures ["LlamaForCausalLMEagle3"], vocab_size = the target's,
    draft_vocab_size, num_hidden_layers 1 and the aux layer ids under
    eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's convention (output of layer k);
    model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d and no embeddings (SGLang
    uses the target's). EAGLE-3.1: `fc_norm: true` (tensors fc_norm.{i}.weight) and
    `norm_output: true` when the drafter has them, as SGLang's llama_eagle3.py reads them since
    sgl-project/sglang#24663; it has no norm_before_fc or norm_before_residual (it would load
    such an export and ignore them), so those are refused.
vllm: the speculators format: speculators_model_type "eagle3", transformer_layer_config, the
    aux ids at the top level in vLLM's convention (SGLang's + 1), every norm flag written out,
    the drafter's (vLLM reads a missing norm_before_residual as true); layers.0.* keys,
    embeddings included, and input_norm.weight (norm_before_fc), fc_norm.{i}.weight (fc_norm).

An MLA drafter (`attention: mla`) is served by both engines as Eagle3DeepseekV2ForCausalLM
(vLLM 0.32's deepseek_eagle3.py; SGLang's models/deepseek_eagle3.py), from one DeepSeek-V3 layer
config (`mla_layer_config`), not the speculators format (speculators knows llama and qwen3
layers only). Its model_type is "kimi_k2" (vLLM's config registry reads it as DeepseekV3Config;
recent SGLang registers the same alias), not "deepseek_v3": vLLM 0.32 turns a draft config of
model_type deepseek_v3 into its MTP model.
Weights under vLLM's/SGLang's names (q_a_proj and kv_a_proj_with_mqa apart: both engines fuse
them on load).
    vllm: the aux ids at the top level (vLLM's convention), `num_aux_hidden_states`, the three
        norm flags vLLM's class reads (fc_norm, norm_output, norm_before_residual; it has no
        input_norm, so norm_before_fc is refused); layers.0.* keys, embeddings included. A
        layer without q_lora_rank is refused: vLLM 0.32's loader cannot place its
        kv_a_proj_with_mqa (it maps the name into fused_qkv_a_proj, absent then).
    sglang: the aux ids under eagle_config (SGLang's convention); midlayer.* keys, no
        embeddings; SGLang's class reads none of EAGLE-3.1's options, so all four are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglet.errors import EagletError
from eaglet.formats.io import read_json, write_json
from eaglet.model.arch import FIELDS, MLA, rope, served_rope_scaling
from eaglet.model.drafter import Drafter, DrafterConfig

DTYPE = "bfloat16"  # what both engines serve drafts in
SPECULATORS_VERSION = "0.3.0"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SGLANG_NORMS = ("fc_norm", "norm_output")  # the EAGLE-3.1 options SGLang's drafter reads
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # vLLM's and SGLang's class of the MLA layer
MLA_ARCHITECTURES = (MLA_ARCHITECTURE, "Eagle3DeepseekV3ForCausalLM")  # the alias both register
MLA_MODEL_TYPE = "kimi_k2"  # see the module doc
VLLM_MLA_NORMS = ("fc_norm", "norm_output", "norm_before_residual")  # what deepseek_eagle3 reads


def layer_config(cfg: DrafterConfig) -> dict:
    """The Llama decoder-layer fields both formats share."""
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": served_rope_scaling(cfg.rope_scaling),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def mla_layer_config(cfg: DrafterConfig) -> dict:
    """The DeepSeek-V3 decoder-layer fields of an MLA drafter, both formats."""
    rope_scaling = layer_config(cfg)["rope_scaling"]
    return {
        "model_type": MLA_MODEL_TYPE,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def mla_config(cfg: DrafterConfig, fmt: str, differs: dict | None = None) -> dict:
    """config.json of an MLA drafter's export (the module doc)."""
    served = VLLM_MLA_NORMS if fmt == "vllm" else ()
    unserved = [f for f in NORM_FLAGS if getattr(cfg, f) and f not in served]
    if unserved:
        engine = "vLLM" if fmt == "vllm" else "SGLang"
        raise EagletError(
            f"export --to {fmt}: {engine}'s MLA EAGLE-3 drafter ({MLA_ARCHITECTURE}) has no "
            f"{' or '.join(unserved)} (it would load the export and ignore it): train without it"
        )
    if fmt == "vllm" and cfg.q_lora_rank is None:
        raise EagletError(
            f"export --to vllm: vLLM 0.32's {MLA_ARCHITECTURE} cannot load an MLA layer without "
            "q_lora_rank (its loader puts kv_a_proj_with_mqa into fused_qkv_a_proj, which only "
            "exists with one): export --to sglang, or train with arch.q_lora_rank set"
        )
    out = {
        "architectures": [MLA_ARCHITECTURE],
        **mla_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": DTYPE,
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if fmt == "vllm":
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg.aux_layer_ids]
        out["num_aux_hidden_states"] = len(cfg.aux_layer_ids)  # else vLLM assumes 3
        out |= {f: getattr(cfg, f) for f in VLLM_MLA_NORMS}
    else:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    return out | _provenance(differs)


def sglang_config(cfg: DrafterConfig, differs: dict | None = None) -> dict:
    unserved = [f for f in NORM_FLAGS if getattr(cfg, f) and f not in SGLANG_NORMS]
    if unserved:
        raise EagletError(
            f"export --to sglang: SGLang's EAGLE-3 drafter has no {' or '.join(unserved)} (it "
            "would load the export and ignore it): export --to vllm, or train without it"
        )
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": DTYPE,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    out |= {f: True for f in SGLANG_NORMS if getattr(cfg, f)}  # absent: false
    return out | _provenance(differs)


def _provenance(differs: dict | None) -> dict:
    """eaglet's own record (engines ignore it): the target's value of every layer field where
    the drafter's differs (null: the target has no such field, e.g. MLA's head_dim)."""
    return {"eaglet": {"arch_differs_from_target": differs or {}}}


def vllm_config(
    cfg: DrafterConfig, verifier: dict, num_steps: int, differs: dict | None = None
) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_steps}],
            "verifier": verifier,
        },
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": (
            None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size
        ),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        **{f: getattr(cfg, f) for f in NORM_FLAGS},
        "embed_requires_grad": False,
        "torch_dtype": DTYPE,
    } | _provenance(differs)


def tensors(model: Drafter, fmt: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the format's names, floats in the export dtype."""
    out = {}
    for name, t in model.state_dict().items():
        if fmt == "sglang" and name == "embed_tokens.weight":
            continue
        if fmt == "vllm":
            name = name.replace("midlayer.", "layers.0.", 1)
        t = t.detach().cpu()
        out[name] = (t.to(getattr(torch, DTYPE)) if t.is_floating_point() else t).contiguous()
    return out


def write(
    model: Drafter,
    fmt: str,
    folder: Path,
    verifier: dict,
    num_steps: int = 3,
    differs: dict | None = None,
) -> None:
    """Write config.json and model.safetensors of the format into `folder`."""
    cfg = model.cfg
    if cfg.attention == "mla":
        config = mla_config(cfg, fmt, differs)
    elif fmt == "sglang":
        config = sglang_config(cfg, differs)
    else:
        config = vllm_config(cfg, verifier, num_steps, differs)
    write_json(folder / "config.json", config)
    save_file(tensors(model, fmt), str(folder / "model.safetensors"), metadata={"format": "pt"})


def expected_shapes(cfg: DrafterConfig, fmt: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the format requires (§3 of the notes), by name."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer = "midlayer" if fmt == "sglang" else "layers.0"
    shapes = {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        f"{layer}.input_layernorm.weight": (h,),
        f"{layer}.hidden_norm.weight": (h,),
        **{f"{layer}.self_attn.{n}.weight": shape for n, shape in attention_shapes(cfg).items()},
        f"{layer}.post_attention_layernorm.weight": (h,),
        f"{layer}.mlp.gate_proj.weight": (i, h),
        f"{layer}.mlp.up_proj.weight": (i, h),
        f"{layer}.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if fmt == "vllm":
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    n, th = len(cfg.aux_layer_ids), cfg.target_hidden_size
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (n * th,)
    if cfg.fc_norm:
        shapes |= {f"fc_norm.{j}.weight": (th,) for j in range(n)}
    return shapes


def attention_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The attention's tensors (under self_attn.), by name."""
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    if cfg.attention != "mla":
        kv = cfg.num_key_value_heads * d
        return {
            "q_proj": (heads * d, 2 * h),
            "k_proj": (kv, 2 * h),
            "v_proj": (kv, 2 * h),
            "o_proj": (h, heads * d),
        }
    r, rope, n, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = {"q_proj": (heads * (n + rope), 2 * h)}
    else:
        q_lora = cfg.q_lora_rank
        q = {
            "q_a_proj": (q_lora, 2 * h),
            "q_a_layernorm": (q_lora,),
            "q_b_proj": (heads * (n + rope), q_lora),
        }
    return q | {
        "kv_a_proj_with_mqa": (r + rope, 2 * h),
        "kv_a_layernorm": (r,),
        "kv_b_proj": (heads * (n + dv), r),
        "o_proj": (h, heads * dv),
    }


def _need(config: dict, key: str, where: Path):
    if key not in config:
        raise EagletError(f"{where}: missing field '{key}'")
    return config[key]


def _internal(name: str) -> str:
    """A speculators tensor name as the drafter module calls it."""
    return name.replace("layers.0.", "midlayer.", 1)


def read_config(folder: Path) -> tuple[str, DrafterConfig]:
    """The format and the drafter config an export folder's config.json describes."""
    where = folder / "config.json"
    try:
        c = read_json(where)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise EagletError(f"{where}: unreadable: {e}") from None
    mla = c.get("architectures") in [[a] for a in MLA_ARCHITECTURES]
    fmt, layer, ids, target_h, norms = _layout(c, mla, where)
    if _need(layer, "num_hidden_layers", where) != 1:
        raise EagletError(f"{where}: num_hidden_layers must be 1")
    if layer.get("tie_word_embeddings", False):
        raise EagletError(f"{where}: tie_word_embeddings must be false")
    values = _layer_fields(layer, mla, where)
    scaling = rope(layer)[1]
    cfg = DrafterConfig(
        draft_vocab_size=_need(c, "draft_vocab_size", where),
        target_hidden_size=target_h,
        aux_layer_ids=tuple(ids),
        rope_scaling=scaling,
        **values,
        **norms,
    )
    return fmt, cfg


def _layout(c: dict, mla: bool, where: Path) -> tuple[str, dict, list[int], int, dict]:
    """Where each of the four export shapes keeps what: (format, the decoder layer's section,
    the aux layer ids in SGLang's numbering, the target's width, the norm flags)."""
    if mla and "eagle_aux_hidden_state_layer_ids" in c:  # vLLM's (its ids at the top level)
        ids = [i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]]
        target_h = c.get("target_hidden_size") or _need(c, "hidden_size", where)
        norms = {flag: c.get(flag) is True for flag in VLLM_MLA_NORMS}  # absent: false there
        if c.get("norm_before_fc"):
            raise EagletError(f"{where}: vLLM's {MLA_ARCHITECTURE} ignores norm_before_fc")
        return "vllm", c, ids, target_h, norms
    if mla:
        eagle = _need(c, "eagle_config", where)
        ids = _need(eagle, "eagle_aux_hidden_state_layer_ids", where / "eagle_config")
        target_h = c.get("target_hidden_size") or _need(c, "hidden_size", where)
        unread = [f for f in NORM_FLAGS if c.get(f)]
        if unread:
            raise EagletError(f"{where}: SGLang's {MLA_ARCHITECTURE} ignores {', '.join(unread)}")
        return "sglang", c, ids, target_h, {}
    if c.get("speculators_model_type") == "eagle3":
        layer = _need(c, "transformer_layer_config", where)
        norms = {flag: _need(c, flag, where) for flag in NORM_FLAGS}
        for flag, value in norms.items():
            if not isinstance(value, bool):
                raise EagletError(f"{where}: {flag} must be true or false, not {value!r}")
        ids = [i - 1 for i in _need(c, "eagle_aux_hidden_state_layer_ids", where)]
        return "vllm", layer, ids, c.get("target_hidden_size") or layer["hidden_size"], norms
    if c.get("architectures") == ["LlamaForCausalLMEagle3"]:
        eagle = _need(c, "eagle_config", where)
        ids = _need(eagle, "eagle_aux_hidden_state_layer_ids", where / "eagle_config")
        target_h = c.get("target_hidden_size") or c["hidden_size"]
        norms = {flag: c.get(flag) is True for flag in SGLANG_NORMS}
        unread = [f for f in NORM_FLAGS if f not in SGLANG_NORMS and c.get(f)]
        if unread:
            raise EagletError(f"{where}: SGLang's EAGLE-3 drafter ignores {', '.join(unread)}")
        return "sglang", c, ids, target_h, norms
    raise EagletError(f"{where}: neither an SGLang EAGLE-3 nor a speculators eagle3 config")


def _layer_fields(layer: dict, mla: bool, where: Path) -> dict:
    """The decoder layer's DrafterConfig fields (rope_scaling aside: optional, read by `rope`);
    an MLA layer's sizes, its kv heads and head_dim derived (eaglet.model.arch)."""
    fields = (*(f for f in FIELDS if f != "rope_scaling"), "vocab_size")
    if mla:  # no kv heads or head_dim of its own
        fields = tuple(f for f in fields if f not in ("num_key_value_heads", "head_dim"))
    values = {f: _need(layer, f, where) for f in fields}
    if mla:
        sizes = {f: _need(layer, f, where) for f in MLA[1:]}
        values |= {"attention": "mla", "q_lora_rank": layer.get("q_lora_rank"), **sizes}
        values["num_key_value_heads"] = values["num_attention_heads"]
        values["head_dim"] = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    return values


def load_export(folder: Path, embed: torch.Tensor | None = None) -> tuple[str, Drafter]:
    """Rebuild a drafter from an export folder alone (SGLang's: embeddings given, the target's)."""
    fmt, cfg = read_config(folder)
    where = folder / "model.safetensors"
    try:
        found = load_file(str(where))
    except (FileNotFoundError, OSError) as e:
        raise EagletError(f"{where}: unreadable: {e}") from None
    shapes = expected_shapes(cfg, fmt)
    missing = sorted(set(shapes) - set(found))
    extra = sorted(set(found) - set(shapes))
    if missing or extra:
        raise EagletError(f"{where}: missing tensors {missing}, unexpected tensors {extra}")
    for name, shape in shapes.items():
        if tuple(found[name].shape) != shape:
            raise EagletError(f"{where}: {name} has shape {list(found[name].shape)}, not {shape}")
    if found["d2t"].dtype != torch.int64 or found["t2d"].dtype != torch.bool:
        raise EagletError(f"{where}: d2t must be int64 and t2d bool")
    ids = torch.arange(cfg.draft_vocab_size) + found["d2t"]
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise EagletError(f"{where}: d2t does not map to ascending target ids")
    if int(found["t2d"].sum()) != cfg.draft_vocab_size or not bool(found["t2d"][ids].all()):
        raise EagletError(f"{where}: t2d does not mark exactly the draft vocab of d2t")
    state = {_internal(n): t.float() if t.is_floating_point() else t for n, t in found.items()}
    if fmt == "sglang":
        if embed is None:
            raise EagletError(f"{folder}: an SGLang export uses the target's embeddings: give them")
        state["embed_tokens.weight"] = embed.float()
    model = Drafter(cfg)
    model.load_state_dict(state, strict=True)
    return fmt, model.eval()
