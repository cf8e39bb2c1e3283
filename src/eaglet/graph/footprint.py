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

The node's disk at once (`node_disk`, for `eaglet plan`): the target's weights, the hidden
states (shards + token ids, or the ids alone online), DVC's cache copy of what `make store`
adds (none where `cache.type` links: `dvc_cache`), the spool of the engine's
full-precision states, training's folders and the exports. `disk_options` re-prices it with
one thing changed each: fewer samples of the largest dataset, another storage, linked DVC
cache, a second disk for the hidden states, online mode.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from eaglet.device import resolve_device

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FIT_FRACTION = 0.8  # the rest: the drafter, activations, the KV cache and the process itself
DVC_DEFAULT = "reflink,copy"  # DVC's cache.type where no config sets it
LINKS = {"hardlink", "symlink"}  # cache types that never copy (reflink copies off XFS/Btrfs)


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


def dvc_cache(root: Path) -> dict:
    """DVC's `cache.type` in the project above `root` (.dvc/config, then .dvc/config.local) and
    whether `dvc add` leaves a second copy: no where hardlink or symlink is listed (they work
    wherever the cache shares data/'s filesystem); reflink alone links only on XFS or Btrfs."""
    repo = next((p for p in (root, *root.parents) if (p / ".dvc").is_dir()), None)
    types, source, cache_dir = DVC_DEFAULT, "DVC's default", None
    for name in ("config", "config.local") if repo else ():
        found = _ini(repo / ".dvc" / name, "cache")
        types, source = (found["type"], f".dvc/{name}") if "type" in found else (types, source)
        cache_dir = found.get("dir", cache_dir)
    kinds = {t.strip() for t in types.split(",")}
    return {"type": types, "from": source, "dir": cache_dir, "copies": not kinds & LINKS}


def _ini(path: Path, section: str) -> dict:
    """The keys of one [section] of a DVC config file (INI), {} where there is none."""
    out, current = {}, None
    for line in path.read_text().splitlines() if path.exists() else ():
        s = line.strip()
        if s.startswith("["):
            current = s.strip("[]").strip()
        elif current == section and "=" in s:
            key, value = (x.strip() for x in s.split("=", 1))
            out[key] = value
    return out


def node_disk(m: dict, mode: str, **change) -> dict:
    """What the node's disk holds at once under hidden.mode `mode`, part by part (expected and
    max hidden tokens), from `m`: tokens {expected, max}, token_bytes, id_bytes, weights,
    spool {mode: bytes}, train, exports, copies, free. `change` overrides any of them."""
    m = m | change
    tokens = m["tokens"]
    per_token = m["id_bytes"] + (0 if mode == "online" else m["token_bytes"])
    hidden = {k: None if v is None else v * per_token for k, v in tokens.items()}
    stored = {k: None if v is None else v + m["train"] + m["exports"] for k, v in hidden.items()}
    parts = {
        "target_weights": {"expected": m["weights"], "max": m["weights"]},
        "hidden_states": hidden,
        "dvc_cache_copy": {k: v if m["copies"] else 0 for k, v in stored.items()},
        "hidden_spool": dict.fromkeys(("expected", "max"), m["spool"][mode]),
        "training_folders": dict.fromkeys(("expected", "max"), m["train"]),
        "exports": dict.fromkeys(("expected", "max"), m["exports"]),
    }
    total = {k: _total(p[k] for p in parts.values()) for k in ("expected", "max")}
    fits = {k: None if v is None else v <= m["free"] for k, v in total.items()}
    return {"mode": mode, "parts": parts, "total": total, "fits": fits, "free_bytes": m["free"]}


def _total(values) -> float | None:
    values = list(values)
    return None if None in values else sum(values)


def disk_options(m: dict, mode: str, largest: dict | None, storages: dict[str, float]) -> list:
    """Each single change that shrinks the expected total, with its new total and verdict:
    `largest` {dataset, tokens, answered}: the max_samples of it that makes the total fit;
    `storages` {setting: bytes a token}: other hidden-state storages."""
    now = node_disk(m, mode)
    total, free = now["total"]["expected"], m["free"]
    if total is None:
        return []
    out = []
    if largest and largest["answered"] and mode != "online":
        t = m["tokens"]["expected"]
        rest = node_disk(m, mode, tokens={"expected": t - largest["tokens"], "max": None})
        rest = rest["total"]["expected"]
        per_sample = (total - rest) / largest["answered"]
        n = math.floor((free - rest) / per_sample) if free > rest else 0
        out.append(
            {
                "option": "fewer_samples",
                "change": f"datasets.{largest['dataset']}.max_samples",
                "dataset": largest["dataset"],
                "max_samples": n,
                "now": round(largest["answered"]),
                "rest_bytes": rest,
                "total_bytes": rest + n * per_sample,
                "fits": n >= 1,
            }
        )
    for setting, token_bytes in storages.items():
        if mode != "online" and token_bytes < m["token_bytes"]:
            out.append(
                _option("storage", setting, node_disk(m, mode, token_bytes=token_bytes), now)
            )
    if m["copies"]:
        out.append(_option("dvc_link", "cache.type", node_disk(m, mode, copies=False), now))
    hidden = now["parts"]["hidden_states"]["expected"]
    moved = hidden + now["parts"]["hidden_spool"]["expected"]
    moved += hidden if m["copies"] else 0
    second = {"option": "second_disk", "change": "data/hidden and hidden.spool on a second disk"}
    out.append(second | {"needs_bytes": moved, "total_bytes": total - moved})
    out[-1]["fits"] = total - moved <= free
    if mode != "online":
        out.append(_option("online", "hidden.mode", node_disk(m, "online"), now))
    return out


def _option(kind: str, change: str, after: dict, now: dict) -> dict:
    total = after["total"]["expected"]
    return {
        "option": kind,
        "change": change,
        "total_bytes": total,
        "saves_bytes": now["total"]["expected"] - total,
        "fits": after["fits"]["expected"],
    }
