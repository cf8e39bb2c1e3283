"""Greedy chain speculative decoding of a target with an EAGLE-3 drafter (batch 1), and the
plain greedy decoding it must reproduce token for token.

A round: the drafter proposes `num_steps` tokens in a chain from the last verified position;
the target scores the current token and the proposals in one forward pass, keeps the longest
prefix of proposals equal to its own argmax, and adds its next token (the bonus). Both caches
roll back to the verified positions; the drafter then reads the target's features of the new
positions (step-0 entries, as in training) and proposes again. Acceptance length, SGLang's
definition: generated tokens / verification rounds, the bonus token included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eaglet.drafter import Drafter, KVCache


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens kept
    seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)


class Target:
    """The target model stepping over a growing sequence, returning argmax ids and aux states."""

    def __init__(self, model, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        self.model, self.cache_type = model, DynamicCache
        self.index = [i + 1 for i in aux_layer_ids]  # SGLang id i = HF hidden_states[i + 1]
        self.device = next(model.parameters()).device

    def new_cache(self):
        return self.cache_type()

    def forward(self, ids: list[int], cache, aux: bool = False) -> tuple[Tensor, Tensor | None]:
        """Argmax next ids [T] after each of `ids`, and the aux states [1, T, 3, H] if asked."""
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=aux,
        )
        states = None
        if aux:
            states = torch.stack([out.hidden_states[i] for i in self.index], dim=2)
        return out.logits[0].argmax(-1), states


def crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _done(tokens: list[int], new: int, max_new: int, stop: set[int]) -> bool:
    """Whether decoding ends: enough tokens, or a stop token among the `new` last ones."""
    return len(tokens) >= max_new or any(t in stop for t in tokens[-new:])


def _finish(tokens: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Cut at the first stop token (kept) and at max_new tokens."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stop:
            return tokens[: i + 1]
    return tokens[:max_new]


@torch.inference_mode()
def greedy(target: Target, prompt: list[int], max_new: int, stop: set[int]) -> Decoded:
    """Plain greedy decoding, one target forward per token."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    nxt, _ = target.forward(prompt, cache)
    tokens = [int(nxt[-1])]
    while not _done(tokens, 1, max_new, stop):
        nxt, _ = target.forward(tokens[-1:], cache)
        tokens.append(int(nxt[-1]))
    return Decoded(tokens, seconds=time.perf_counter() - t0)


@torch.inference_mode()
def speculate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new: int,
    stop: set[int],
    num_steps: int,
) -> Decoded:
    """Greedy chain speculative decoding; returns the tokens and the acceptance per round."""
    t0 = time.perf_counter()
    dev = target.device
    tcache, dcache = target.new_cache(), KVCache()
    nxt, aux = target.forward(prompt, tcache, aux=True)
    tokens = [int(nxt[-1])]
    # step-0 entries: at position s the drafter reads the target's features of s and token s+1
    ids_next = [*prompt[1:], tokens[-1]]
    pos = torch.arange(len(prompt), device=dev)
    feats = drafter.features(aux.to(drafter.fc.weight.dtype))
    h = drafter.step(feats, _ids(ids_next, dev), pos, dcache)
    verified = len(prompt)  # positions both caches hold; tokens[-1] sits at this position
    accepted: list[int] = []
    while not _done(tokens, accepted[-1] + 1 if accepted else 1, max_new, stop):
        last, drafts = h[:, -1:], []
        for k in range(num_steps):  # the chain: position verified-1+k reads draft k-1
            draft = drafter.to_target(drafter.logits(last).argmax(-1))
            drafts.append(int(draft))
            if k + 1 < num_steps:
                p = torch.tensor([verified + k], device=dev)
                last = drafter.step(last, draft, p, dcache)
        nxt, aux = target.forward([tokens[-1], *drafts], tcache, aux=True)
        n = 0
        while n < num_steps and drafts[n] == int(nxt[n]):
            n += 1
        accepted.append(n)
        new = [*drafts[:n], int(nxt[n])]
        crop(tcache, verified + n + 1)
        dcache.crop(verified)
        pos = torch.arange(verified, verified + n + 1, device=dev)
        feats = drafter.features(aux[:, : n + 1].to(drafter.fc.weight.dtype))
        h = drafter.step(feats, _ids(new, dev), pos, dcache)
        verified += n + 1
        tokens += new
    return Decoded(_finish(tokens, max_new, stop), accepted, time.perf_counter() - t0)


def _ids(ids: list[int], device) -> Tensor:
    return torch.tensor([ids], device=device)


def acceptance(results: list[Decoded], num_steps: int) -> dict:
    """Acceptance length (tokens / rounds), the mean acceptance length as vLLM counts it (1 +
    accepted drafts / rounds: no prefill token) and the rate at each draft position, given the
    drafts before it were accepted."""
    tokens = sum(len(r.tokens) for r in results)
    rounds = sum(r.rounds for r in results)
    kept = [n for r in results for n in r.accepted]
    reached = [sum(n >= i for n in kept) for i in range(num_steps + 1)]
    return {
        "acceptance_length": tokens / rounds if rounds else None,
        "mean_acceptance_length": 1 + sum(kept) / rounds if rounds else None,
        "acceptance_rate": [
            reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, num_steps + 1)
        ],
        "generated_tokens": tokens,
        "rounds": rounds,
    }


def against_greedy(same: list[bool], tps: float, greedy_tps: float | None) -> dict:
    """How a speculative run compares with plain greedy decoding of the same prompts (its speed:
    None when the greedy reference was decoded elsewhere)."""
    return {
        "greedy_equal": all(same),
        "greedy_mismatches": same.count(False),
        "tokens_per_s": round(tps, 2),
        "greedy_tokens_per_s": round(greedy_tps, 2) if greedy_tps else None,
        "speedup": round(tps / greedy_tps, 3) if greedy_tps else None,
    }
