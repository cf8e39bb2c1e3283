"""The EAGLE-3 drafter: one Llama decoder layer over fused target features, nanoGPT-style.

B batch, T positions, H hidden size (the target's by default), V target vocab, Vd draft vocab,
K aux layers of the target's width Ht. At position t a drafting step reads the embedding of the
token *after* t and a hidden state: at the first step the fused target features of position t,
at later steps what the step before carried forward at t. It predicts the token after that.

    hidden = fc(cat(aux_1, ..., aux_K))                          # first step only
    x = cat(input_layernorm(embed(token)), hidden_norm(hidden))  # [B, T, 2H]
    h = hidden + o_proj(attention(x))                            # the residual is the raw hidden
    h = h + mlp(post_attention_layernorm(h))                     # carried to the next step
    logits = lm_head(norm(h))                                    # [B, T, Vd]

EAGLE-3.1's options (`arch`, each false by default: the lines above are EAGLE-3 as published),
read by vLLM from the config fields of the same names (llama_eagle3.py):

    fc_norm:              fc(cat(fc_norm_1(aux_1), ..., fc_norm_K(aux_K)))  # each state normed
    norm_before_fc:       fc(input_norm(cat(aux_1, ..., aux_K)))            # one norm over all
    norm_before_residual: h = hidden_norm(hidden) + o_proj(attention(x))
    norm_output:          norm(h) is carried to the next step (logits = lm_head(norm(h)) still)

`attention: mla` (MLA targets: Kimi-K2.5, DeepSeek-V3) puts DeepSeek-V3's multi-head latent
attention in place of attention(x) above, its projections reading the same 2H-wide x (vLLM's
and SGLang's Eagle3DeepseekV2ForCausalLM; r = kv_lora_rank, n/p/dv = qk_nope/qk_rope/v head dims):

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))          # [B, T, heads·(n+p)]; q_proj(x) if no q_lora
    c, k_pe = split(kv_a_proj_with_mqa(x), [r, p])    # the latent (what serving caches) + one key
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)))   # per head: [n], [dv]
    q = cat(q_nope, rope(q_pe)); k = cat(k_nope, rope(k_pe))  # k_pe shared by every head
    attention = softmax(q·k · scale) v                 # scale: (n+p)^-0.5 x YaRN's mscale^2

RoPE there rotates pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), the rope part only. The
layer caches the decompressed k and v, so training's TTT runs unchanged.

Draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocab. Parameter
names are SGLang's (`midlayer.*`), so a state dict is an SGLang checkpoint up to the frozen
embeddings. Decoding appends to a KVCache; training runs all steps at once (`forward`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from eaglet.model.arch import MLA, NORMS
from eaglet.model.arch import resolve as resolve_arch


@dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # Vd
    hidden_size: int  # H
    target_hidden_size: int  # the target's H: fc reads one state per aux layer
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...]  # SGLang convention: the output of decoder layer k
    rope_scaling: dict | None = None  # YaRN: {rope_type: yarn, factor, ...}; None: plain RoPE
    # EAGLE-3.1 (the module doc); a false one is left out of to_dict(): the drafters trained
    # before these options existed have the same config.json
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # the layer's attention (eaglet.model.arch): "llama", or "mla" with the MLA sizes (left out
    # of to_dict() for a Llama layer, like a false norm option)
    attention: str = "llama"
    q_lora_rank: int | None = None  # None: q_proj reads the input directly
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @classmethod
    def from_target(
        cls,
        target: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        arch: dict | None = None,
        where: str = "target config",
    ) -> DrafterConfig:
        """Sizes from the target's text config (a dict, or a config object) and `arch`, the
        params' choices over the defaults of eaglet.model.arch (Llama-like: mirror one target layer;
        MLA: the published Kimi drafters' shape)."""
        text = target if isinstance(target, dict) else _as_dict(target)
        resolved = resolve_arch(text, arch or {}, where)
        return cls(
            vocab_size=text["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=text["hidden_size"],
            aux_layer_ids=tuple(aux_layer_ids),
            **resolved,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        if self.attention == "llama":
            d = {k: v for k, v in d.items() if k not in ("attention", *MLA)}
        return {k: v for k, v in d.items() if k not in NORMS or v}

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        return cls(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})


def _as_dict(config: Any) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(d: int, theta: float, scaling: dict | None) -> tuple[Tensor, float]:
    """(inverse frequencies [d/2], factor on cos/sin) of RoPE, or of YaRN when `scaling` says:
    dimensions rotating fewer than beta_slow times over the original context are interpolated
    (frequency / factor), those rotating more than beta_fast times kept, a linear ramp between,
    and cos/sin scaled by the attention factor (0.1·ln(factor) + 1, or the mscale ratio)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if scaling is None:
        return inv_freq, 1.0
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return inv_freq, float(attn)


def rope(x: Tensor, pos: Tensor, inv_freq: Tensor, factor: float = 1.0) -> Tensor:
    """Rotary position embedding (Llama's rotate-half form) of x [B, heads, T, d] at pos [T]."""
    d = x.shape[-1]
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_pairs(x: Tensor, pos: Tensor, inv_freq: Tensor, factor: float = 1.0) -> Tensor:
    """Rotary position embedding of x [B, heads, T, d] at pos [T] over the pairs (x0, x1),
    (x2, x3), ...: DeepSeek's MLA layout (vLLM's is_neox_style=False)."""
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = (freqs.cos() * factor).to(x.dtype), (freqs.sin() * factor).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def yarn_mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_scales(qk_head_dim: int, scaling: dict | None) -> tuple[float, float]:
    """(factor on cos/sin, softmax scale) of an MLA layer, as DeepSeek's YaRN has them (vLLM's
    DeepseekScalingRotaryEmbedding and DeepseekV2MLAAttention, transformers' DeepseekV3):
    cos/sin by mscale(mscale) / mscale(mscale_all_dim), the scores by (n+p)^-0.5 x
    mscale(mscale_all_dim)^2 (not when attention_factor is 1: vLLM's deepseek_llama_scaling)."""
    scale = qk_head_dim**-0.5
    if scaling is None:
        return 1.0, scale
    f, m, m_all = scaling["factor"], scaling.get("mscale") or 1.0, scaling.get("mscale_all_dim")
    m_all = m_all or 0.0
    if scaling.get("attention_factor") != 1.0:
        scale *= yarn_mscale(f, m_all) ** 2
    return yarn_mscale(f, m) / yarn_mscale(f, m_all), scale


class KVCache:
    """The drafter layer's keys and values so far, each [B, kv_heads, S, head_dim] (an MLA
    layer's values: v_head_dim)."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def add(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


SCORES = 2**24  # attention scores held at once (fp32: 64 MiB), whatever the sequence length
RECOMPUTE = 2048  # positions (B x T) above which training goes in chunks, recomputed in backward
CHAIN = 512  # positions (B x T) of one such chunk of TTT steps 1..
# score(k, states [B, c, H] that TTT step k carries forward at positions start.., start) -> tensors
# to sum (Drafter.logits takes such states)
Score = Callable[[int, Tensor, int], tuple[Tensor, ...]]


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past: int,
    diagonal: list[tuple[Tensor, Tensor]],
    scores: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(q·k·scale)·v (scale 1/√d unless given), causal: query i sits at position
    past + i and sees the keys at positions <= its own, plus, from each (k, v) pair in
    `diagonal`, the one key at the query's own index. q [B, h, T, d]; k [B, kv_h, S, d], v
    [B, kv_h, S, dv]; diagonal pairs [B, kv_h, T, d] and [B, kv_h, T, dv].

    Queries go in chunks of rows so that at most `scores` (default SCORES) exist at once;
    under autograd, when there is more than one chunk, a chunk's scores are recomputed in
    backward rather than kept, so memory grows linearly with T (compute stays quadratic)."""
    if not diagonal and past == 0 and q.shape[2] == k.shape[2]:  # plain causal: the fused kernel
        d, dv = q.shape[-1], v.shape[-1]
        if dv < d:  # MLA: values padded to the key width, else SDPA's T x T fallback kernel runs
            v = F.pad(v, (0, d - dv))
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, scale=scale
            )[..., :dv]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # kv heads repeated to the query heads; the diagonal ones broadcast instead
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dk, dv = [kd for kd, _ in diagonal], [vd for _, vd in diagonal]
    b, h, t, _ = q.shape
    rows = max(1, (scores or SCORES) // (b * h * k.shape[2]))
    out = []
    for i in range(0, t, rows):
        j = min(i + rows, t)
        seen = min(past + j, k.shape[2])  # the last key any query of the chunk may see
        args = (q[:, :, i:j], k[:, :, :seen], v[:, :, :seen], past + i)
        args += ([x[:, :, i:j] for x in dk], [x[:, :, i:j] for x in dv], scale)
        out.append(recomputed(_attend_rows, *args) if rows < t else _attend_rows(*args))
    return torch.cat(out, dim=2)


def _attend_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    dk: list[Tensor],
    dv: list[Tensor],
    scale: float | None = None,
) -> Tensor:
    """attend() for the queries at positions start.., over keys k, v of the query head count
    and diagonal keys dk, dv of the kv head count (query head i reads kv head i // groups)."""
    b, h, t, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qpos = torch.arange(t, device=q.device)[:, None] + start
    causal = qpos >= torch.arange(k.shape[2], device=q.device)[None, :]
    scores = [(q @ k.transpose(-2, -1) * scale).masked_fill(~causal, float("-inf"))]
    kv = dk[0].shape[1] if dk else h
    per_kv = q.view(b, kv, h // kv, t, d)  # query heads grouped under their kv head
    scores += [(per_kv * kd[:, :, None]).sum(-1).reshape(b, h, t, 1) * scale for kd in dk]
    w = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    s = k.shape[2]
    out = w[..., :s] @ v
    for j, vd in enumerate(dv):
        wj = w[..., s + j : s + j + 1].view(b, kv, h // kv, t, 1)
        out = out + (wj * vd[:, :, None]).reshape(b, h, t, vd.shape[-1])
    return out


def attend_cached(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, diagonal: list | None, scale=None
) -> Tensor:
    """attend() of the new positions' queries q [B, h, T, d] with their keys and values: in
    decoding, or the first training step (diagonal None), appended to the cache and attended
    causally; in a later training step, the step-0 keys causally (the queries are the cache's
    last T positions) and then this position's own chain (`diagonal`, k and v appended)."""
    if diagonal is None:
        past = len(cache)
        keys, values = cache.add(k, v)
    else:
        past = len(cache) - q.shape[2]
        diagonal.append((k, v))
        keys, values = cache.k, cache.v
    return attend(q, keys, values, past, diagonal or [], scale=scale)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d
        inv_freq, self.rope_factor = rope_frequencies(d, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(
        self, x: Tensor, pos: Tensor, cache: KVCache, diagonal: list | None = None
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = rope(q, pos, self.inv_freq, self.rope_factor)
        k = rope(k, pos, self.inv_freq, self.rope_factor)
        out = attend_cached(q, k, v, cache, diagonal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention (the module doc), vLLM's parameter names."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, heads, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        self.heads, self.q_lora_rank, self.kv_lora_rank = heads, cfg.q_lora_rank, r
        n, p, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.nope, self.rope, self.v_dim = n, p, dv
        inv_freq, _ = rope_frequencies(p, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_factor, self.scale = mla_scales(n + p, cfg.rope_scaling)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(2 * h, heads * (n + p), bias=False)
        else:
            self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * (n + p), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, r + p, bias=False)
        self.kv_a_layernorm = RMSNorm(r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(r, heads * (n + dv), bias=False)
        self.o_proj = nn.Linear(heads * dv, h, bias=False)

    def forward(
        self, x: Tensor, pos: Tensor, cache: KVCache, diagonal: list | None = None
    ) -> Tensor:
        b, t, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(b, t, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        v = v.contiguous()  # kept values of their own: k_nope's half of kv can be freed
        q_pe = rope_pairs(q_pe, pos, self.inv_freq, self.rope_factor)
        k_pe = rope_pairs(k_pe[:, None], pos, self.inv_freq, self.rope_factor)  # one head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, self.heads, t, self.rope)], dim=-1)
        out = attend_cached(q, k, v, cache, diagonal, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # norms the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # norms the incoming hidden state
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def forward(
        self, emb: Tensor, hidden: Tensor, pos: Tensor, cache: KVCache, diagonal=None
    ) -> Tensor:
        emb, normed = self.input_layernorm(emb), self.hidden_norm(hidden)
        x = torch.cat([emb, normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.self_attn(x, pos, cache, diagonal)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
        n_aux, th, eps = len(cfg.aux_layer_ids), cfg.target_hidden_size, cfg.rms_norm_eps
        if cfg.norm_before_fc:  # vLLM's name: input_norm.weight
            self.input_norm = RMSNorm(n_aux * th, eps)
        if cfg.fc_norm:  # fc_norm.{i}.weight, one per aux layer
            self.fc_norm = nn.ModuleList(RMSNorm(th, eps) for _ in range(n_aux))
        self.fc = nn.Linear(n_aux * th, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        for m in (self.fc, self.lm_head, *self.midlayer.modules()):
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def features(self, aux: Tensor) -> Tensor:
        """Fuse the target's states [B, T, K, Ht] (K aux layers) into a hidden state [B, T, H]."""
        x = aux.flatten(-2)  # [B, T, K·Ht]: cat(aux_1, ..., aux_K)
        if self.cfg.norm_before_fc:  # one norm over the concatenation
            x = self.input_norm(x)
        if self.cfg.fc_norm:  # each aux state normed apart (after input_norm, as vLLM does)
            parts = zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1), strict=True)
            x = torch.cat([norm(a) for norm, a in parts], dim=-1)
        return self.fc(x)

    def carried(self, h: Tensor) -> Tensor:
        """What a step carries to the next from the layer's output h: norm(h) under
        norm_output (EAGLE-3.1), else h itself, the final norm's input (EAGLE-3)."""
        return self.norm(h) if self.cfg.norm_output else h

    def step(self, hidden: Tensor, ids: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
        """One decoding step over new positions: hidden [B, T, H], next-token ids [B, T]; what
        it carries forward (`carried`)."""
        return self.carried(self.midlayer(self.embed_tokens(ids), hidden, pos, cache))

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head(norm(h)) from what a step carried forward (already norm(h) under norm_output)."""
        return self.lm_head(hidden if self.cfg.norm_output else self.norm(hidden))

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self, aux: Tensor, input_ids: Tensor, steps: int, score: Score | None = None
    ) -> list[Tensor] | tuple[Tensor, ...]:
        """Training-time test: `steps` chained drafting steps at every position; per step its
        logits [B, T, Vd], or with `score` the sums over positions of what score(k, states,
        start) makes of the states [B, c, H] step k carries forward at positions start.. (before
        the final norm, or after it under norm_output: `carried`; training's loss and hits: a
        tuple of [steps] tensors).

        Step k at position t reads token t+k+1 (teacher-forced) and what step k-1 carried at t,
        sits at position t+k, and attends to the step-0 keys of positions <= t plus its own
        chain (steps 1..k at t): exactly what chain decoding from position t sees. Its logits
        predict token t+k+2. Tokens past the end read id 0 (the caller masks them).

        With `score`, a batch of more than RECOMPUTE positions goes in chunks of positions: step
        0 over all of them (its keys and values are what every later step attends to), then per
        chunk of at most CHAIN positions the later steps and every step's score, both
        recomputed in backward under autograd. Per position only step 0's input, output, keys
        and values are then kept, whatever the number of steps.
        """
        b, t = input_ids.shape
        hidden = self.features(aux)
        if score is None or b * t <= RECOMPUTE:  # every position at once, nothing recomputed
            hidden, k0, v0 = self.ttt_step(hidden, input_ids, 0)
            args = (hidden, input_ids, steps, k0, v0, 0)
            if score is None:
                return self.chain(*args, lambda k, state, start: self.logits(state))
            return self.chain_sums(*args, score)
        hidden, k0, v0 = recomputed(self.ttt_step, hidden, input_ids, 0)
        width = max(1, CHAIN // b)
        parts = [
            recomputed(self.chain_sums, h, input_ids, steps, k0, v0, i * width, score)
            for i, h in enumerate(hidden.split(width, dim=1))
        ]
        return tuple(torch.stack(x).sum(0) for x in zip(*parts, strict=True))

    def chain(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        steps: int,
        k0: Tensor,
        v0: Tensor,
        start: int,
        score: Score,
    ) -> list:
        """score(k, step k's output, start) for each step k, from step 0's output hidden [B, c, H]
        at positions start..start+c and step 0's keys and values k0, v0 (all positions)."""
        diagonal, out = [], []
        for k in range(steps):
            if k:
                hidden, *kv = self.ttt_step(hidden, input_ids, k, k0, v0, *diagonal, start=start)
                diagonal += kv
            out.append(score(k, hidden, start))
        return out

    def chain_sums(self, *args: Any) -> tuple[Tensor, ...]:
        """chain(*args) with each of the scores' parts stacked over the steps."""
        return tuple(torch.stack(x) for x in zip(*self.chain(*args), strict=True))

    def ttt_step(
        self, hidden: Tensor, input_ids: Tensor, k: int, *keys: Tensor, start: int = 0
    ) -> tuple:
        """TTT step k at positions start..start+c from what step k-1 carried there, hidden
        [B, c, H] (step 0: the fused features), and the keys and values (k0, v0, k1, v1, ...) of
        step 0 (every position) and of steps 1..k-1 (these positions): (what it carries forward,
        its keys, its values). Pure, so that backward can rerun it."""
        c, t = hidden.shape[1], input_ids.shape[1]
        ids = F.pad(input_ids[:, k + 1 :], (0, min(k + 1, t)))[:, start : start + c]
        pos = torch.arange(start, start + c, device=input_ids.device) + k
        cache, diagonal = KVCache(), None
        if k:  # the step-0 keys causally (those these positions see), then their own chain
            cache.k, cache.v = keys[0], keys[1]
            if start + c < t:
                cache.crop(start + c)
            diagonal = [(keys[i], keys[i + 1]) for i in range(2, len(keys), 2)]
        hidden = self.carried(self.midlayer(self.embed_tokens(ids), hidden, pos, cache, diagonal))
        return hidden, *(diagonal[-1] if k else (cache.k, cache.v))


def recomputed(fn: Callable, *args: Any) -> Any:
    """fn(*args); under autograd its activations are recomputed in backward, not kept."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
