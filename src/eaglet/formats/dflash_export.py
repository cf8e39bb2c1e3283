"""The DFlash serving folder: config.json in z-lab's layout plus model.safetensors.

One folder for both engines. z-lab's layout (`architectures: ["DFlashDraftModel"]`, a Qwen3
layer config, `dflash_config: {target_layer_ids, mask_token_id, block_size}`) is what SGLang's
DFLASH reads (`parse_dflash_draft_config`: target_layer_ids 0-based as outputs of the target's
layers, block_size in dflash_config or at the top level, mask_token_id) and what vLLM 0.32's
DFlashQwen3ForCausalLM reads (it adds one to each target layer id to get its aux ids). The
speculators layout (`speculators_model_type: dflash`) is vLLM's only. Two traps this layout
avoids, both silent: a top-level `eagle_aux_hidden_state_layer_ids` would win over
dflash_config in vLLM *without* the +1; a missing `head_dim` reads as Qwen3's 128.

Tensors carry z-lab's names (vLLM prefixes `model.`): fc, hidden_norm, layers.i.*, norm,
lm_head, and d2t with a reduced vocabulary (vLLM reads it as draft_id_to_target_id). No
embed_tokens: the drafter trains on the target's own, which engines then share.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglet.formats.io import read_json, write_json
from eaglet.model.arch import served_rope_scaling
from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.dflash.model import DFlash

ARCHITECTURE = "DFlashDraftModel"
DTYPE = "bfloat16"  # what engines serve drafts in


def config_json(cfg: DFlashConfig) -> dict:
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,  # Qwen3Config's default is 128
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": served_rope_scaling(cfg.rope_scaling),
        # vLLM 0.32 does not raise it for dflash: it bounds max-model-len + B
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "torch_dtype": DTYPE,
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    # eaglet's own record (engines ignore it): the config it trained under
    out["eaglet"] = {"method": "dflash", "config": cfg.to_dict()}
    return out


def tensors(model: DFlash, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name == "embed_tokens.weight" or name == "t2d":
            continue
        if name == "d2t" and model.cfg.full_vocab:
            continue  # no mapping: vLLM reads the full vocabulary as the target's
        t = t.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def write(model: DFlash, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json and model.safetensors into `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", config_json(model.cfg))
    save_file(tensors(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})


def load(folder: Path, embed: torch.Tensor | None = None) -> DFlash:
    """An export back as eaglet's module (fp32), the target's embeddings given apart."""
    cfg = DFlashConfig.from_dict(read_json(folder / "config.json")["eaglet"]["config"])
    model = DFlash(cfg)
    state = {
        k: v.float() if v.is_floating_point() else v
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"embed_tokens.weight", "t2d"} | ({"d2t"} if cfg.full_vocab else set())
    if set(missing) - allowed or unexpected:
        raise ValueError(
            f"{folder}: missing {sorted(set(missing) - allowed)}, unexpected {unexpected}"
        )
    if not cfg.full_vocab:
        model.t2d.zero_()
        model.t2d[model.to_target(torch.arange(cfg.draft_vocab_size))] = True
    if embed is not None:
        model.embed_tokens.weight.data.copy_(embed)
    return model.eval()
