"""The DFlash drafter's configuration: one frozen dataclass, checked on construction.

Layer ids follow z-lab's `dflash_config.target_layer_ids` (and SGLang's): id k is the *output*
of target decoder layer k, 0-based, the same numbering as EAGLE-3's `aux_layer_ids` in eaglet
(eaglet.model.drafter). vLLM adds one to each (its aux ids: the residual stream entering layer
k+1), so EAGLE-3's stored states [1, 14, 26] on SmolLM2 are DFlash's too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from eaglet.errors import EagletError


@dataclass(frozen=True)
class DFlashConfig:
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # Vd: V for the full vocabulary, fewer with lm_head + d2t
    hidden_size: int  # H, the target's (the drafter shares its embeddings)
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_target_layers: int  # the target's decoder layers: bounds target_layer_ids
    target_layer_ids: tuple[int, ...]  # ascending: the order fc reads them in
    mask_token_id: int  # a row of the target's embedding the target never emits
    block_size: int = 8  # B: the anchor token and B-1 masks; serve with B-1 speculative tokens
    num_layers: int = 1  # draft decoder layers
    rope_scaling: dict | None = None  # YaRN as eaglet.model.drafter reads it; None: plain RoPE

    def __post_init__(self) -> None:
        where = "dflash"
        if self.block_size < 2:
            raise EagletError(
                f"{where}.block_size: {self.block_size}; a block is the anchor token and at "
                "least one mask (block_size >= 2)"
            )
        if self.num_layers < 1:
            raise EagletError(f"{where}.num_layers: {self.num_layers}; at least 1")
        ids = list(self.target_layer_ids)
        if not ids or any(not 0 <= i < self.num_target_layers for i in ids):
            raise EagletError(
                f"{where}.target_layer_ids: {ids}; each must be a decoder layer of the target "
                f"(0..{self.num_target_layers - 1}, the output of that layer)"
            )
        if ids != sorted(set(ids)):
            raise EagletError(
                f"{where}.target_layer_ids: {ids}; ascending and distinct (engines concatenate "
                "the states in ascending layer order)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise EagletError(
                f"{where}.mask_token_id: {self.mask_token_id}; not a row of the target's "
                f"embedding (0..{self.vocab_size - 1})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise EagletError(
                f"{where}.draft_vocab_size: {self.draft_vocab_size}; 1..{self.vocab_size}"
            )

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.vocab_size

    @classmethod
    def from_target(cls, text: dict, **choices: Any) -> DFlashConfig:
        """Layer sizes mirror one target layer (its text config as a dict); `choices` are
        DFlash's own fields (target_layer_ids, mask_token_id, block_size, num_layers,
        draft_vocab_size) or overrides of a size."""
        heads = text["num_attention_heads"]
        sizes = {
            "vocab_size": text["vocab_size"],
            "draft_vocab_size": text["vocab_size"],
            "hidden_size": text["hidden_size"],
            "target_hidden_size": text["hidden_size"],
            "intermediate_size": text["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": text.get("num_key_value_heads") or heads,
            "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
            "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
            "rope_theta": _rope_theta(text),
            "max_position_embeddings": text["max_position_embeddings"],
            "num_target_layers": text["num_hidden_layers"],
            "rope_scaling": text.get("rope_scaling"),
        }
        sizes |= choices
        sizes["target_layer_ids"] = tuple(sizes["target_layer_ids"])
        return cls(**sizes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        return cls(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})


def _rope_theta(text: dict) -> float:
    # transformers 5 moves rope_theta into rope_parameters
    if "rope_theta" in text:
        return float(text["rope_theta"])
    return float((text.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n target layers spread evenly from layer 1 to layer N-3 (z-lab's and SGLang's
    build_target_layer_ids: one target layer per draft layer by default; the middle one for
    n = 1)."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]
