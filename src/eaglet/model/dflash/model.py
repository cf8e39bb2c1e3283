"""The DFlash drafter, nanoGPT-style: one forward pass drafts a whole block.

B batch, T target positions, A blocks (anchors) per sample, S block size, H hidden size, n
target layers of width Ht, V target vocab, Vd draft vocab.

A block anchored at position a is [x_a, MASK x (S-1)] at positions a..a+S-1; slot k >= 1
predicts x_{a+k}. Its context is the target's states at positions < a, the ones a serving
engine has when the target has just produced x_a:

    ctx = hidden_norm(fc(cat(h_1, ..., h_n)))          # [B, T, H], layers in ascending order
    x = embed(block)                                    # [B, A·S, H], the target's embeddings
    for each layer:                                     # Qwen3 layers, pre-norm
        y = input_layernorm(x)
        q = rope(q_norm(q_proj(y)), block positions)
        k = [rope(k_norm(k_proj(ctx)), 0..T-1) ; rope(k_norm(k_proj(y)), block positions)]
        v = [v_proj(ctx) ; v_proj(y)]                   # ctx: the same for every layer (no norm)
        x = x + o_proj(attention(q, k, v))              # a block sees ctx < a and its own S slots
        x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                           # [B, A·S, Vd]; draft id i = i + d2t[i]

Attention inside a block is non-causal (every slot sees every slot of its block); blocks never
see each other. That is vLLM's DFlashQwen3ForCausalLM (qwen3_dflash.py): context K/V from
`k_norm(k_proj(hidden_norm(fc(...))))` with RoPE at the context positions and no input norm,
written into every layer's cache; the query block through the layers. Parameter names are the
export's (z-lab's), so a state dict is a checkpoint up to the frozen embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eaglet.model.dflash.config import DFlashConfig
from eaglet.model.drafter import MLP, RMSNorm, rope_frequencies


def rope_at(x: Tensor, pos: Tensor, inv_freq: Tensor, factor: float = 1.0) -> Tensor:
    """Llama's rotate-half RoPE (vLLM's neox style) of x [B, heads, T, d] at pos [B, T]: a
    position per sample, since blocks sit at each sample's own anchors."""
    d = x.shape[-1]
    freqs = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    cos, sin = (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # per head, before RoPE (Qwen3)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _split(self, x: Tensor, heads: int) -> Tensor:  # [B, T, heads·d] -> [B, heads, T, d]
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def forward(
        self, y: Tensor, ctx: Tensor, pos: Tensor, ctx_pos: Tensor, seen: Tensor, rot: tuple
    ) -> Tensor:
        """y [B, Q, H] normed block inputs, ctx [B, T, H] the injected context, pos [B, Q] and
        ctx_pos [B, T] their positions, seen [B, Q, T+Q] what each query may attend to."""
        q = rope_at(self.q_norm(self._split(self.q_proj(y), self.heads)), pos, *rot)
        k_blk = rope_at(self.k_norm(self._split(self.k_proj(y), self.kv_heads)), pos, *rot)
        k_ctx = rope_at(self.k_norm(self._split(self.k_proj(ctx), self.kv_heads)), ctx_pos, *rot)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat(
            [
                self._split(self.v_proj(ctx), self.kv_heads),
                self._split(self.v_proj(y), self.kv_heads),
            ],
            2,
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None], enable_gqa=True)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # gate/up/down with SiLU, as Qwen3's (and eaglet's EAGLE-3 layer)

    def forward(self, x: Tensor, ctx: Tensor, pos, ctx_pos, seen, rot) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, pos, ctx_pos, seen, rot)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_factor = factor
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def context(self, aux: Tensor) -> Tensor:
        """The injected context hidden_norm(fc(cat(h_1..h_n))) from aux [B, T, n, Ht] (the
        target layers in ascending order, as the hidden-state store keeps them)."""
        return self.hidden_norm(self.fc(aux.flatten(-2)))

    def forward(self, aux: Tensor, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """Logits [B, A, S, Vd] of the blocks anchored at `anchors` [B, A] (a position per
        block, 1 <= a < T; a padding anchor of -1 is computed but sees no context) over
        samples of target states aux [B, T, n, Ht] and tokens input_ids [B, T]."""
        b, t = input_ids.shape
        a, s = anchors.shape[1], self.cfg.block_size
        offsets = torch.arange(s, device=anchors.device)
        pos = (anchors.clamp(min=0)[..., None] + offsets).reshape(b, a * s)  # [B, A·S]
        first = input_ids.gather(1, anchors.clamp(min=0))  # x_a, the token the target just made
        blocks = torch.full((b, a, s), self.cfg.mask_token_id, device=input_ids.device)
        blocks[..., 0] = first
        x = self.embed_tokens(blocks.reshape(b, a * s))
        ctx = self.context(aux)
        ctx_pos = torch.arange(t, device=aux.device).expand(b, t)
        seen = self.visibility(anchors, t)
        rot = (self.inv_freq, self.rope_factor)
        for layer in self.layers:
            x = layer(x, ctx, pos, ctx_pos, seen, rot)
        return self.lm_head(self.norm(x)).view(b, a, s, -1)

    def visibility(self, anchors: Tensor, t: int) -> Tensor:
        """[B, A·S, T + A·S] bool: a query of the block at a sees context positions < a and
        every slot of its own block (non-causal), nothing of other blocks."""
        b, a = anchors.shape
        s = self.cfg.block_size
        ctx = torch.arange(t, device=anchors.device) < anchors[..., None]  # [B, A, T]
        ctx = ctx[:, :, None, :].expand(b, a, s, t).reshape(b, a * s, t)
        block = torch.arange(a, device=anchors.device).repeat_interleave(s)
        own = (block[:, None] == block[None, :]).expand(b, a * s, a * s)
        return torch.cat([ctx, own], dim=-1)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> Tensor:
        """[V] long: the draft id of each target id, -1 where the draft vocab lacks it."""
        out = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        out[self.to_target(ids)] = ids
        return out
