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

    @classmethod
    def of(cls, arch: dict, target_hidden: int, vocab: int, draft_vocab: int, steps: int):
        """From a resolved `drafters.<d>.arch` (eaglet.model.arch.resolve)."""
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
        )

    def trainable(self) -> int:
        """Parameters trained: fc, the layer (q, k, v, o, MLP, three norms), norm, lm_head."""
        h, a, k = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 2 * h * (a + 2 * k) + a * h
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
    inputs = 3 * 2 * h * a if bf16 else 2 * h * f  # q/k/v read cat(...): cast thrice, or as is
    mlp_in = 2 * h * a if bf16 else h * f  # gate and up read the post-attention norm
    attention = 2 * q * a  # rotated queries, the output reshaped for o_proj
    repeats = 0 if q == kv else 4 * q * a  # GQA: step-0 keys, values per query head; grads
    mlp = 4 * i * a + 3 * i * a  # gate, up, silu, product; then their gradients in backward
    residual = h * a + 2 * h * f  # the attention residual; gradient transients
    return embedding + norms + inputs + mlp_in + attention + repeats + mlp + residual


def per_token(s: Shape, dtype: str, host_batch: bool = False) -> float:
    """Derived bytes per token of one micro-batch (before CALIBRATION). host_batch: the
    collated batch lives in the same memory (CPU training), fp32."""
    a, h = act_bytes(dtype), s.hidden
    kv = s.kv_heads * s.head_dim
    inputs = 3 * s.target_hidden * a + 4 * s.target_hidden
    if host_batch:  # fp32 aux and final states collated; on CPU fp32 they are the same tensors
        inputs = 16 * s.target_hidden + (3 * s.target_hidden * a if a != 4 else 0)
    kept = (2 * h + 2 * kv) * a  # fused features; step 0's output, keys, values
    chunks = (h + 4 * kv) * a  # gradients of step 0's output, keys and values (twice)
    first = (h + 2 * kv) * a + layer_bytes(s, dtype)  # the same gradients; step 0's layer
    return inputs + kept + max(chunks, first)


def fixed_bytes(s: Shape, dtype: str) -> dict[str, float]:
    """The fixed part, itemised (bytes)."""
    p = s.trainable()
    rows = max(1, LOGITS // s.draft_vocab)
    kv = s.kv_heads * s.head_dim
    chain_step = layer_bytes(s, dtype) + (2 * s.hidden + 2 * kv) * act_bytes(dtype)
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
