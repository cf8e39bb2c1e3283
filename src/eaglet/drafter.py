"""The EAGLE-3 drafter: one Llama decoder layer over fused target features, nanoGPT-style.

B batch, T positions, H hidden size (the target's by default), V target vocab, Vd draft vocab.
At position t a drafting step reads the embedding of the token *after* t and a hidden state:
at the first step the fused target features fc(cat(low, mid, high)) of position t, at later
steps the drafter's own output at t from the step before. It predicts the token after that.

    x = cat(input_layernorm(embed(token)), hidden_norm(hidden))   # [B, T, 2H]
    h = hidden + o_proj(attention(x))                             # the residual is the raw hidden
    h = h + mlp(post_attention_layernorm(h))                      # fed back as the next hidden
    logits = lm_head(norm(h))                                     # [B, T, Vd]

Draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocab. Parameter
names are SGLang's (`midlayer.*`), so a state dict is an SGLang checkpoint up to the frozen
embeddings. Decoding appends to a KVCache; training runs all steps at once (`forward`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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

    @classmethod
    def from_target(
        cls, target: Any, draft_vocab_size: int, aux_layer_ids: list[int]
    ) -> DrafterConfig:
        """Sizes from the target's transformers config (the drafter mirrors one target layer)."""
        rope = getattr(target, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target, "rope_theta", 10000.0))
        heads = target.num_attention_heads
        return cls(
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            hidden_size=target.hidden_size,
            target_hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
            rms_norm_eps=float(target.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=target.max_position_embeddings,
            aux_layer_ids=tuple(aux_layer_ids),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        return cls(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (Llama's rotate-half form) of x [B, heads, T, d] at pos [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """The drafter layer's keys and values so far, each [B, kv_heads, S, head_dim]."""

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


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, diagonal: list[tuple[Tensor, Tensor]]
) -> Tensor:
    """softmax(q·k/√d)·v over the keys `mask` [T, S] allows, plus, from each (k, v) pair in
    `diagonal`, the one key at the query's own position. q [B, h, T, d]; k, v [B, kv_h, S, d]."""
    groups = q.shape[1] // k.shape[1]

    def heads(t: Tensor) -> Tensor:
        return t.repeat_interleave(groups, dim=1)

    scale = q.shape[-1] ** -0.5
    scores = [(q @ heads(k).transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))]
    scores += [(q * heads(kd)).sum(-1, keepdim=True) * scale for kd, _ in diagonal]
    w = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    s = k.shape[2]
    out = w[..., :s] @ heads(v)
    for j, (_, vd) in enumerate(diagonal):
        out = out + w[..., s + j : s + j + 1] * heads(vd)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d
        self.theta = cfg.rope_theta
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
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        if diagonal is None:  # decoding, or the first training step: causal over the cache
            past = len(cache)
            keys, values = cache.add(k, v)
            qi = torch.arange(t, device=x.device)[:, None] + past
            mask = qi >= torch.arange(past + t, device=x.device)[None, :]
        else:  # a later training step: step-0 keys causally, then this position's own chain
            diagonal.append((k, v))
            keys, values = cache.k, cache.v
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        out = attend(q, keys, values, mask, diagonal or [])
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
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def forward(
        self, emb: Tensor, hidden: Tensor, pos: Tensor, cache: KVCache, diagonal=None
    ) -> Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, pos, cache, diagonal)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
        n_aux = len(cfg.aux_layer_ids)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
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
        return self.fc(aux.flatten(-2))

    def step(self, hidden: Tensor, ids: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
        """One decoding step over new positions: hidden [B, T, H], next-token ids [B, T]."""
        return self.midlayer(self.embed_tokens(ids), hidden, pos, cache)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self, aux: Tensor, input_ids: Tensor, steps: int, masks: list[Tensor] | None = None
    ) -> list[Tensor]:
        """Training-time test: `steps` chained drafting steps at every position; logits per step
        (at the positions of masks[k] [B, T] only, [N_k, Vd], when masks are given).

        Step k at position t reads token t+k+1 (teacher-forced) and the step k-1 output at t,
        sits at position t+k, and attends to the step-0 keys of positions <= t plus its own
        chain (steps 1..k at t): exactly what chain decoding from position t sees. Its logits
        predict token t+k+2. Tokens past the end read id 0 (the caller masks them).
        """
        t = input_ids.shape[1]
        hidden = self.features(aux)
        cache, diagonal, out = KVCache(), [], []
        for k in range(steps):
            ids = F.pad(input_ids[:, k + 1 :], (0, min(k + 1, t)))
            pos = torch.arange(t, device=input_ids.device) + k
            emb = self.embed_tokens(ids)
            hidden = self.midlayer(emb, hidden, pos, cache, diagonal if k else None)
            out.append(self.logits(hidden if masks is None else hidden[masks[k]]))
        return out
