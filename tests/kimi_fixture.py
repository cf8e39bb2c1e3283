"""A tiny random target shaped like Kimi-K2.5: a multimodal wrapper config (`kimi_k25`, whose
remote code eaglet never loads) with the language model under `text_config` (DeepSeek-V3: MLA,
MoE, YaRN), weights under a `language_model.` prefix in sharded safetensors with an index, and
a vision tensor beside them. The tokenizer and chat template are SmolLM2's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# Kimi-K2.5's text_config with every size shrunk (real values in the comments)
TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 49152,  # 163840 (SmolLM2's tokenizer here)
    "hidden_size": 64,  # 7168
    "intermediate_size": 96,  # 18432, the dense MLP of the first layer
    "moe_intermediate_size": 32,  # 2048
    "num_hidden_layers": 8,  # 61
    "num_attention_heads": 4,  # 64
    "num_key_value_heads": 4,  # 64
    "q_lora_rank": 32,  # 1536
    "kv_lora_rank": 16,  # 512
    "qk_nope_head_dim": 16,  # 128
    "qk_rope_head_dim": 8,  # 64
    "v_head_dim": 16,  # 128
    "n_routed_experts": 4,  # 384
    "num_experts_per_tok": 2,  # 8
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "max_position_embeddings": 512,  # 262144
    "rope_scaling": {
        "type": "yarn",
        "factor": 8.0,  # 64
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64,  # 4096
    },
    "tie_word_embeddings": False,
}
WRAPPER = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "vision_config": {"hidden_size": 32, "patch_size": 14},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
PREFIX = "language_model."


def tiny_kimi(path: Path, tokenizer_from: str, shards: int = 3, seed: int = 0) -> Path:
    """Write the tiny Kimi-shaped target into `path` (a folder) and return it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TEXT, bos_token_id=1, eos_token_id=2))
    state = {PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}
    state["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(WRAPPER | {"text_config": TEXT}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, path / name)
    return path
