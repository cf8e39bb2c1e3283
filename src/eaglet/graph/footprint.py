"""What a target weighs, and whether it fits here: arithmetic on config.json alone.

`parameters()` counts the language model's parameters from its text config: embeddings (and an
untied lm_head), per layer the attention (MLA when `kv_lora_rank` is set: q low-rank or full,
the joint KV latent + RoPE key, its up-projection, the output) and the MLP (dense, or MoE:
routed + shared experts and the router past `first_k_dense_replace`; DeepseekV3's defaults of
1 shared expert and 3 dense layers where the config omits them). Norms and biases are left out
(under 0.01 %). `kv_bytes_per_token()` is the serving engine's KV cache per token on one GPU:
MLA keeps one latent of `kv_lora_rank + qk_rope_head_dim` per layer, replicated on every
tensor-parallel rank; multi-head/grouped attention keeps K and V of its KV heads, split across
ranks. `fits_here()` decides whether in-process evaluation may load the target: its weights in
the evaluation dtype within FIT_FRACTION of this machine's memory (RAM, or the GPU's).
"""

from __future__ import annotations

import os

from eaglet.device import resolve_device

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FIT_FRACTION = 0.8  # the rest: the drafter, activations, the KV cache and the process itself


def parameters(text: dict) -> int:
    """Parameter count of the language model a text config describes."""
    h, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    heads = text["num_attention_heads"]
    if text.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi-K2)
        qk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        rank = text.get("q_lora_rank")
        q = h * rank + rank * heads * qk if rank else h * heads * qk
        kv = h * (text["kv_lora_rank"] + text["qk_rope_head_dim"])
        kv += text["kv_lora_rank"] * heads * (text["qk_nope_head_dim"] + text["v_head_dim"])
        attn = q + kv + heads * text["v_head_dim"] * h
    else:
        kv_heads = text.get("num_key_value_heads") or heads
        hd = text.get("head_dim") or h // heads
        attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
    dense = 3 * h * text["intermediate_size"]
    experts = text.get("n_routed_experts") or text.get("num_local_experts") or 0
    mlp = layers * dense
    if experts:
        dense_layers = text.get("first_k_dense_replace", 3)
        per_expert = 3 * h * text.get("moe_intermediate_size", text["intermediate_size"])
        moe = (experts + text.get("n_shared_experts", 1)) * per_expert + experts * h
        mlp = dense_layers * dense + (layers - dense_layers) * moe
    tied = text.get("tie_word_embeddings", False)
    return vocab * h * (1 if tied else 2) + layers * attn + mlp


def kv_bytes_per_token(text: dict, tensor_parallel: int = 1, dtype_bytes: int = 2) -> float:
    """KV cache bytes per token on one GPU of a tensor-parallel engine."""
    layers = text["num_hidden_layers"]
    if text.get("kv_lora_rank"):  # the latent is replicated on every rank
        return layers * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * dtype_bytes
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    hd = text.get("head_dim") or text["hidden_size"] // heads
    return layers * 2 * kv_heads * hd * dtype_bytes / min(tensor_parallel, kv_heads)


def memory_here(device: str) -> int:
    """Total memory of `device` on this machine in bytes: the GPU's, or the RAM (also where a
    driver is present but this torch cannot query the GPU)."""
    device = resolve_device(device)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            return torch.cuda.get_device_properties(index).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def in_process_bytes(text: dict, dtype: str) -> int:
    """Bytes of the target's weights loaded in-process in `dtype`."""
    return parameters(text) * DTYPE_BYTES[dtype]


def fits_here(text: dict, dtype: str, device: str) -> bool:
    """Whether the target in `dtype` fits in FIT_FRACTION of `device`'s memory here."""
    return in_process_bytes(text, dtype) <= FIT_FRACTION * memory_here(device)


def in_process(evaluate: dict, text: dict) -> bool:
    """Whether the evaluate stage decodes in-process: `in_process`, `auto` resolved by fit."""
    if evaluate["in_process"] != "auto":
        return evaluate["in_process"]
    return fits_here(text, evaluate["dtype"], evaluate["device"])
