"""A miniature Kimi-K2.5 as the hub ships it, built in seconds (written for the tests, not copied).

- config.json: the `kimi_k25` wrapper (remote-code `auto_map`, a vision config, the media token)
  with `text_config` holding every field of K2.5's DeepSeek-V3 text config: the router
  (`noaux_tc`, `sigmoid`, `e_score_correction_bias`), MLA with Kimi's own latent (kv_lora_rank 512
  + qk_rope_head_dim 64: the only size vLLM's CPU MLA kernel runs) and YaRN; other sizes shrunk.
- Weights in the hub's layout: one tensor per routed expert, the language model under
  `language_model.`, indexed shards, a vision tensor beside them (bf16 on the hub with INT4
  experts; fp32 here).
- preprocessor_config.json: the media processor config vLLM builds the wrapper's processor from.
- The tokenizer is repository code only: `tokenization_kimi.TikTokenTokenizer` (our miniature of
  Kimi's class, tests/fixtures/kimi/) over `tiktoken.model`, Kimi's special tokens at Kimi's
  offsets (163584 + k there, 512 + k here), and a chat template in Kimi's structure (roles
  `<|im_user|>` ..., `<think>` reasoning, tool calls sections, tool declarations in TypeScript).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

FILES = Path(__file__).parent / "fixtures" / "kimi"
ORDINARY = 512  # 256 bytes + 256 byte-pair merges (163584 in K2.5)
VOCAB = ORDINARY + 256  # special and reserved tokens above (163840 in K2.5)
# Kimi-K2.5's special tokens, at their offsets from its first special id 163584
SPECIAL = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip
THINK = ORDINARY + 22
IM_END = ORDINARY + 2
TOOL_MARKERS = (11, 12, 13, 14, 15)  # `special: false` in K2.5's tokenizer_config.json

TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": ORDINARY,
    "eos_token_id": ORDINARY + 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 64,  # 7168
    "initializer_range": 0.02,
    "intermediate_size": 96,  # 18432, the dense MLP of the first layer
    "kv_lora_rank": 512,  # 512: Kimi's own (vLLM's CPU MLA kernel runs 512 + 64 only)
    "max_position_embeddings": 1024,  # 262144 (= factor x original, as in K2.5)
    "model_type": "kimi_k2",  # as the hub ships it: transformers maps it to DeepSeek-V3
    "moe_intermediate_size": 32,  # 2048
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 4,  # 384
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 2,  # 64
    "num_experts_per_tok": 2,  # 8
    "num_hidden_layers": 8,  # 61
    "num_key_value_heads": 2,  # 64
    "num_nextn_predict_layers": 0,
    "pad_token_id": ORDINARY + 255,
    "pretraining_tp": 1,
    "q_lora_rank": 32,  # 1536
    "qk_nope_head_dim": 32,  # 128
    "qk_rope_head_dim": 64,  # 64: Kimi's own
    "rms_norm_eps": 1e-5,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,  # 64
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64,  # 4096
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "float32",  # bfloat16
    "use_cache": True,
    "v_head_dim": 32,  # 128
    "vocab_size": VOCAB,  # 163840
}
VISION = {
    "model_type": "kimi_k25_vision",
    "patch_size": 14,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
}
WRAPPER = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "bos_token_id": ORDINARY,
    "eos_token_id": ORDINARY + 1,
    "pad_token_id": ORDINARY + 255,
    "ignore_index": -100,
    "media_placeholder_token_id": ORDINARY + 21,
    "model_type": "kimi_k25",
    "tie_word_embeddings": False,
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "vision_config": VISION,
}
PREPROCESSOR = {
    "auto_map": {"AutoImageProcessor": "kimi_k25_processor.KimiK25VisionProcessor"},
    "media_proc_cfg": {
        "in_patch_limit": 256,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 32,
        "in_patch_limit_each_frame": 256,
        "temporal_merge_kernel_size": 4,
        "sample_fps": 2.0,
        "timestamp_mode": "hh:mm:ss.fff",
    },
}
PREFIX = "language_model."


def merges() -> list[bytes]:
    """The 256 byte pairs above the single bytes: deterministic, common English letters."""
    letters = " etaoinshrdlcumwfgypbvk"
    pairs = ("".join(p).encode() for p in itertools.product(letters, repeat=2))
    return list(itertools.islice((p for p in pairs if p != b"  "), 256))


def write_tokenizer(path: Path) -> None:
    """tiktoken.model, tokenizer_config.json (class in auto_map, no tokenizer.json), the
    class's file and the chat template."""
    ranks = [bytes([b]) for b in range(256)] + merges()
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    names = {k: SPECIAL.get(k, f"<|reserved_token_{k}|>") for k in range(VOCAB - ORDINARY)}
    added = {
        str(ORDINARY + k): {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": k not in TOOL_MARKERS,
        }
        for k, name in names.items()
    }  # fmt: skip
    config = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",  # K2.5's; a turn ends with <|im_end|> (generation_config)
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenization_kimi.py", "chat_template.jinja"):
        shutil.copy(FILES / name, path / name)


def hub_layout(state: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the hub's
    one tensor per routed expert, the language model under `language_model.`."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(n_experts):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(n_experts):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {PREFIX + k: v.contiguous().clone() for k, v in out.items()}


def tiny_kimi(path: Path, shards: int = 3, seed: int = 0) -> Path:
    """Write the miniature Kimi-K2.5 into `path` (a folder) and return it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TEXT))
    with torch.no_grad():
        for layer in model.model.layers[TEXT["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)  # the router's own bias
    state = hub_layout(model.state_dict(), TEXT["n_routed_experts"])
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
    gen = {"bos_token_id": ORDINARY, "eos_token_id": ORDINARY + 2}  # <|im_end|> ends a turn
    (path / "generation_config.json").write_text(json.dumps(gen))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_tokenizer(path)
    return path


def operator_engine(spec, spool: Path, log: Path, connector: tuple[str, str], **serve):
    """An operator's vLLM engine of the miniature for hidden states, started as
    examples/kimi-k2.5.params.yaml's comment says: extract_hidden_states for SGLang's default
    aux layers of 8 layers [1, 3, 4] as vLLM ids + 1 and N = 8, `connector` (class, module)
    writing to `spool`. `serve`: ServeConfig's sizes."""
    from eaglet.engines.vllm.config import ServeConfig
    from eaglet.engines.vllm.server import Engine

    config = ServeConfig.of(
        spec,
        **serve,
        speculative={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}},
        },
        kv_transfer={
            "kv_connector": connector[0],
            "kv_connector_module_path": connector[1],
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(spool)},
        },
    )
    return Engine(config, log=log)
