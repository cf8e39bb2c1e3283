"""Training memory per GPU: peak = fixed + per_token x T, from the drafter's architecture.

What `train.fit` holds for one micro-batch of T positions (the step's only micro-batch on the
device at a time) when it is long (more than drafter.RECOMPUTE positions): step 0 over every
position, its layer recomputed in backward, then TTT steps 1.. and every step's loss in chunks
of drafter.CHAIN positions, each chunk recomputed in backward; the loss in chunks of logits
(target_head.LOGITS). So nothing per token grows with the draft vocab or the TTT depth. With H
the drafter's width, Ht the target's, A = heads x head_dim, K = kv_heads x head_dim, I the MLP
width, a the activation bytes (2 under bf16 autocast, 4 in fp32), per token:

- inputs: aux 3·Ht·a (moved in the compute dtype), the final states 4·Ht (p is fp32)
- kept through the step: the fused features, step 0's output, its keys and values (2H + 2K)·a
- then the larger of two phases of backward:
  - the chunks: the gradients of step 0's output (H·a) and of its keys and values (2K·a, and
    another 2K·a while a chunk's are added in)
  - step 0: the gradients of its output, keys and values, and its recomputed layer's
    activations (`layer_bytes`), fp32 where the code is fp32 (the embedding, the three
    RMSNorms, the concatenated attention input)

Fixed: trainable weights, gradients and AdamW's two moments in fp32 (16 bytes a parameter;
DDP's all-reduce buckets are the gradients themselves), the frozen embeddings [V, H] fp32, the
target head (draft rows fp32, the other rows in the compute dtype), the loss chunk's and the
attention chunk's working sets, one chunk's TTT steps 1.. (their layers' activations and
outputs, keys and values at CHAIN positions), and the CUDA context and allocator slack
(OVERHEAD, assumed).

An MLA layer (`attention: mla`, eaglet.model.drafter) reads the same 2H-wide input through
q_a_proj (or q_proj) and kv_a_proj_with_mqa, norms the q latent (q_lora_rank) and the kv latent
(kv_lora_rank), and keeps its keys and values decompressed: 2K above becomes heads x (qk_nope +
qk_rope) + heads x v_head_dim (`keys_values`), and the attention's saved activations are its
queries (heads x (qk_nope + qk_rope)), its output (heads x v_head_dim), step 0's values padded
to the key width (SDPA's fused kernel needs one width) and the two latents through their norms.
So training an MLA layer keeps no fewer key/value bytes a token than a Llama layer of head_dim
qk_nope (Kimi-K2.5: 20,480 values against 16,384): the latent, kv_lora_rank + qk_rope_head_dim
(576), is what a serving engine caches a token, not what training keeps.

The derived per-token figure is multiplied by CALIBRATION (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
LOGITS = 2**23  # = target_head.LOGITS (not imported: this module stays free of torch)
SCORES = 2**24  # = drafter.SCORES
CHAIN = 512  # = drafter.CHAIN: positions of one chunk of TTT steps 1..
OVERHEAD = 2 * GIB  # CUDA context, cuBLAS workspaces, caching-allocator slack (an assumption)
# a factor on the derived per-token figure; 1.0: the derivation as is (the CPU check in
# docs/drafter.md: measured/derived 0.77 in the demo setting; the Kimi setting's first points
# measured glibc's heap, their rerun with MALLOC_MMAP_THRESHOLD_ is recorded there)
CALIBRATION = 1.0


@dataclass(frozen=True)
class Shape:
    hidden: int
    target_hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    vocab: int
    steps: int
    # an MLA layer (None: a Llama layer); head_dim is then qk_nope + qk_rope (eaglet.model.arch)
    mla: tuple[int | None, int, int, int] | None = None  # q_lora, kv_lora, qk_rope, v_head_dim

    @classmethod
    def of(cls, arch: dict, target_hidden: int, vocab: int, draft_vocab: int, steps: int):
        """From a resolved `drafters.<d>.arch` (eaglet.model.arch.resolve)."""
        mla = None
        if arch.get("attention") == "mla":
            mla = tuple(
                arch[f] for f in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
            )
        return cls(
            hidden=arch["hidden_size"],
            target_hidden=target_hidden,
            intermediate=arch["intermediate_size"],
            heads=arch["num_attention_heads"],
            kv_heads=arch["num_key_value_heads"],
            head_dim=arch["head_dim"],
            draft_vocab=draft_vocab,
            vocab=vocab,
            steps=steps,
            mla=mla,
        )

    def keys_values(self) -> int:
        """Values per token of the layer's keys and values together, as training keeps them."""
        if self.mla is None:
            return 2 * self.kv_heads * self.head_dim
        return self.heads * (self.head_dim + self.mla[3])

    def attention_params(self) -> int:
        """The attention's parameters: Llama's q, k, v, o; MLA's projections and two norms."""
        h, a = self.hidden, self.heads * self.head_dim
        if self.mla is None:
            return 2 * h * (a + 2 * self.kv_heads * self.head_dim) + a * h
        q_lora, r, rope, v = self.mla
        q = 2 * h * a if q_lora is None else 2 * h * q_lora + q_lora + q_lora * a
        nope = self.head_dim - rope
        return q + 2 * h * (r + rope) + r + r * self.heads * (nope + v) + self.heads * v * h

    def trainable(self) -> int:
        """Parameters trained: fc, the layer (attention, MLP, three norms), norm, lm_head."""
        h = self.hidden
        attn = self.attention_params()
        return (
            3 * self.target_hidden * h
            + attn
            + 3 * h * self.intermediate
            + 4 * h
            + self.draft_vocab * h
        )


def act_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def layer_bytes(s: Shape, dtype: str) -> float:
    """Per token, what one TTT step's layer holds while it is recomputed and backpropagated:
    the activations autograd saves (as drafter.py computes them) and the MLP's gradients."""
    a, f, h = act_bytes(dtype), 4, s.hidden
    q, kv, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    bf16 = a < f
    embedding = 2 * h * f  # fp32 embedding and its normalised copy
    norms = 2 * (h * a + (h * f if bf16 else 0))  # hidden_norm, post-attention: input in fp32
    mlp_in = 2 * h * a if bf16 else h * f  # gate and up read the post-attention norm
    mlp = 4 * i * a + 3 * i * a  # gate, up, silu, product; then their gradients in backward
    residual = h * a + 2 * h * f  # the attention residual; gradient transients
    if s.mla is not None:
        q_lora, r, _, v = s.mla
        inputs = 2 * 2 * h * a if bf16 else 2 * h * f  # q_a (or q), kv_a read cat: cast twice
        # each latent: its norm's fp32 input and output, and the projection's input (q_b, kv_b)
        latents = sum(2 * w * a + (w * f if bf16 else 0) for w in (q_lora or 0, r) if w)
        attention = q * a + s.heads * v * a  # queries (rope part rotated), output for o_proj
        attention += (q - s.heads * v) * a  # values padded to the key width (SDPA's fused kernel)
        return embedding + norms + inputs + mlp_in + latents + attention + mlp + residual
    inputs = 3 * 2 * h * a if bf16 else 2 * h * f  # q/k/v read cat(...): cast thrice, or as is
    attention = 2 * q * a  # rotated queries, the output reshaped for o_proj
    repeats = 0 if q == kv else 4 * q * a  # GQA: step-0 keys, values per query head; grads
    return embedding + norms + inputs + mlp_in + attention + repeats + mlp + residual


def per_token(s: Shape, dtype: str, host_batch: bool = False) -> float:
    """Derived bytes per token of one micro-batch (before CALIBRATION). host_batch: the
    collated batch lives in the same memory (CPU training), fp32."""
    a, h = act_bytes(dtype), s.hidden
    kv = s.keys_values()
    inputs = 3 * s.target_hidden * a + 4 * s.target_hidden
    if host_batch:  # fp32 aux and final states collated; on CPU fp32 they are the same tensors
        inputs = 16 * s.target_hidden + (3 * s.target_hidden * a if a != 4 else 0)
    kept = (2 * h + kv) * a  # fused features; step 0's output, keys, values
    chunks = (h + 2 * kv) * a  # gradients of step 0's output, keys and values (twice)
    first = (h + kv) * a + layer_bytes(s, dtype)  # the same gradients; step 0's layer
    return inputs + kept + max(chunks, first)


def fixed_bytes(s: Shape, dtype: str) -> dict[str, float]:
    """The fixed part, itemised (bytes)."""
    p = s.trainable()
    rows = max(1, LOGITS // s.draft_vocab)
    chain_step = layer_bytes(s, dtype) + (2 * s.hidden + s.keys_values()) * act_bytes(dtype)
    return {
        "weights (fp32)": 4 * p,
        "gradients (fp32)": 4 * p,
        "AdamW moments (fp32)": 8 * p,
        "frozen embeddings (fp32)": 4 * s.vocab * s.hidden,
        "target head (draft rows fp32, rest in the compute dtype)": 4
        * s.draft_vocab
        * s.target_hidden
        + act_bytes(dtype) * (s.vocab - s.draft_vocab) * s.target_hidden,
        "loss and attention chunks": 6 * 4 * rows * s.draft_vocab + 4 * 4 * SCORES,
        "TTT steps 1.. of one chunk of positions": CHAIN * (s.steps - 1) * chain_step,
    }


def estimate(s: Shape, tokens: int, dtype: str = "bfloat16", device: str = "cuda") -> dict:
    """Peak bytes of one training process at a micro-batch of `tokens` positions (B x T)."""
    fixed = fixed_bytes(s, dtype)
    if device == "cuda":
        fixed["CUDA context and allocator (assumed)"] = OVERHEAD
    per = per_token(s, dtype, host_batch=device == "cpu") * CALIBRATION
    return {
        "fixed_items": fixed,
        "fixed": sum(fixed.values()),
        "per_token": per,
        "peak": sum(fixed.values()) + per * tokens,
    }


def longest(s: Shape, memory: float, dtype: str = "bfloat16") -> int:
    """The most positions per micro-batch whose estimated peak fits in `memory` bytes."""
    e = estimate(s, 0, dtype)
    return max(0, int((memory - e["fixed"]) // e["per_token"]))
