"""Chain speculative decoding of a target with an EAGLE-3 drafter, greedy (reproducing plain
greedy decoding token for token) or sampled (speculative sampling: the output is distributed as
the target's); every prompt of a call decodes in one batch.

A round: the drafter proposes `num_steps` tokens in a chain from the last verified position;
the target scores the current token and the proposals in one forward pass, keeps the longest
prefix of proposals equal to its own argmax, and adds its next token (the bonus). The drafter
then reads the target's features of the new positions (step-0 entries, as in training) and
proposes again. Acceptance length, SGLang's definition: generated tokens / verification rounds,
the bonus token included.

Sampling at temperature T (`Sampling`), the rule vLLM (`draft_sample_method: greedy`, its
default) and SGLang (target-only verification) serve with: the drafter proposes its argmax, so its
distribution is one-hot; the target accepts proposal x_k with probability p_k(x_k), p_k its
softmax / T, and at the first rejection samples from p_k with x_k removed, renormalized; with
every proposal accepted the bonus token is sampled from p. That is the standard rejection rule
(Leviathan et al. 2023, Chen et al. 2023) for a deterministic draft: each emitted token is
distributed as the target's own sampling would emit it, and the acceptance is the engine's.

Batching: the rows share one target KV cache that grows by `num_steps + 1` slots a round.
Prompts are left-padded; a row's padding and its rejected proposals stay in the cache as slots
its attention mask hides, and each row carries its own position ids, so every row computes what
it would alone. A row leaves the batch when it ends. The drafter (a few ms a step) runs per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from eaglet.model.drafter import Drafter, KVCache


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens kept

    @property
    def rounds(self) -> int:
        return len(self.accepted)


@dataclass
class Sampling:
    """Speculative sampling at `temperature` > 0, drawing from `generator`."""

    temperature: float
    generator: torch.Generator

    def probs(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def draw(self, probs: Tensor) -> int:
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def accept(self, p: Tensor, drafts: list[int]) -> tuple[int, int]:
        """The rejection rule over one chain of argmax proposals: target distributions `p`
        [K + 1, V] (the last for the bonus token). Returns (proposals accepted, the token
        emitted after them)."""
        u = torch.rand(len(drafts), generator=self.generator)
        for k, x in enumerate(drafts):
            if u[k] >= p[k, x]:  # rejected: u >= p / q with q one-hot
                residual = p[k].clone()
                residual[x] = 0.0
                return k, self.draw(residual / residual.sum())
        return len(drafts), self.draw(p[len(drafts)])


class Target:
    """The target model over a batch of sequences, returning argmax ids and aux states."""

    def __init__(self, model, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        self.model, self.cache_type = model, DynamicCache
        self.index = [i + 1 for i in aux_layer_ids]  # SGLang id i = HF hidden_states[i + 1]
        self.device = next(model.parameters()).device

    def new_cache(self):
        return self.cache_type()

    def forward(
        self, ids: Tensor, pos: Tensor, mask: Tensor, cache, aux: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits [B, T, V] after each of `ids` [B, T] at positions `pos` [B, T],
        seeing the cache slots where `mask` [B, slots + T] holds; the aux states [B, T, K, H]
        if asked."""
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask.long(),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=aux,
        )
        states = None
        if aux:
            states = torch.stack([out.hidden_states[i] for i in self.index], dim=2)
        return out.logits, states


def _done(tokens: list[int], new: int, max_new: int, stop: set[int]) -> bool:
    """Whether decoding ends: enough tokens, or a stop token among the `new` last ones."""
    return len(tokens) >= max_new or any(t in stop for t in tokens[-new:])


def _finish(tokens: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Cut at the first stop token (kept) and at max_new tokens."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stop:
            return tokens[: i + 1]
    return tokens[:max_new]


@dataclass
class _Row:
    """One prompt's decoding: its tokens, the positions the target verified, its drafter state."""

    tokens: list[int]
    verified: int  # the position of tokens[-1]
    accepted: list[int] = field(default_factory=list)
    cache: KVCache = field(default_factory=KVCache)  # the drafter's
    last: Tensor | None = None  # the drafter's output state at the last verified position

    def new(self) -> int:
        return self.accepted[-1] + 1 if self.accepted else 1


BATCH = 16  # prompts decoded at once: the shared cache grows by num_steps + 1 slots a round


def decode(
    target: Target,
    prompts: list[list[int]],
    max_new: int,
    stop: set[int],
    drafter: Drafter | None = None,
    num_steps: int = 0,
    ended: Callable[[Decoded], None] | None = None,
    sampling: Sampling | None = None,
) -> list[Decoded]:
    """Decoding of every prompt, BATCH at a time, greedy or with `sampling`: plain without a
    drafter, else chain speculative with `num_steps` drafts a round. `ended` is called as each
    prompt ends."""
    out: list[Decoded] = []
    for i in range(0, len(prompts), BATCH):
        batch = prompts[i : i + BATCH]
        out += _batch(target, batch, max_new, stop, drafter, num_steps, ended, sampling)
    return out


@torch.inference_mode()
def _batch(
    target: Target,
    prompts: list[list[int]],
    max_new: int,
    stop: set[int],
    drafter: Drafter | None,
    num_steps: int,
    ended: Callable[[Decoded], None] | None,
    sampling: Sampling | None,
) -> list[Decoded]:
    """Decode the prompts as one batch (the module docstring says how)."""
    rows, cache, mask = _prefill(target, prompts, drafter, sampling)
    done: dict[int, Decoded] = {}  # the ended rows
    live = list(range(len(rows)))  # rows still decoding, in the cache's batch order
    while True:
        keep = _retire(rows, live, done, max_new, stop, ended)
        if not keep:
            return [done[i] for i in range(len(rows))]
        if len(keep) < len(live):
            index = torch.tensor(keep, device=target.device)
            cache.batch_select_indices(index)
            mask = mask[index]
            live = [live[j] for j in keep]
        mask = _round(target, rows, live, cache, mask, drafter, num_steps, sampling)


def _prefill(
    target: Target, prompts: list[list[int]], drafter: Drafter | None, sampling: Sampling | None
) -> tuple[list[_Row], Any, Tensor]:
    """The prompts through the target, left-padded to one width: a row per prompt with its first
    token (and, with a drafter, its step-0 entries), the target's cache and attention mask."""
    dev = target.device
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts], device=dev)
    slots = torch.arange(width, device=dev)
    ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts], device=dev)
    mask = slots >= pad[:, None]
    cache = target.new_cache()
    logits, aux = target.forward(
        ids, (slots - pad[:, None]).clamp(min=0), mask, cache, drafter is not None
    )
    first = [sampling.draw(sampling.probs(x)) for x in logits[:, -1]] if sampling else None
    rows = [
        _Row([first[i] if first else int(logits[i, -1].argmax())], len(p))
        for i, p in enumerate(prompts)
    ]
    if drafter is not None:  # step-0 entries: position s reads the features of s and token s+1
        for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
            feats = drafter.features(aux[i : i + 1, width - len(p) :].to(drafter.fc.weight.dtype))
            ids_next = torch.tensor([[*p[1:], row.tokens[-1]]], device=dev)
            h = drafter.step(feats, ids_next, torch.arange(len(p), device=dev), row.cache)
            row.last = h[:, -1:]
    return rows, cache, mask


def _retire(
    rows: list[_Row],
    live: list[int],
    done: dict[int, Decoded],
    max_new: int,
    stop: set[int],
    ended: Callable[[Decoded], None] | None,
) -> list[int]:
    """The live rows that have ended go to `done` (and to `ended`); the positions in `live` of
    those still decoding."""
    keep = []
    for j, i in enumerate(live):
        if not _done(rows[i].tokens, rows[i].new(), max_new, stop):
            keep.append(j)
            continue
        done[i] = Decoded(_finish(rows[i].tokens, max_new, stop), rows[i].accepted)
        if ended is not None:
            ended(done[i])
    return keep


def _round(
    target: Target,
    rows: list[_Row],
    live: list[int],
    cache: Any,
    mask: Tensor,
    drafter: Drafter | None,
    num_steps: int,
    sampling: Sampling | None,
) -> Tensor:
    """One verification round of the live rows: each row's chain of drafts through the target
    at once, its accepted drafts and the target's next token appended (and fed to the drafter's
    cache); the attention mask grown by the round, its rejected slots masked."""
    dev = target.device
    drafts = [_chain(drafter, rows[i], num_steps, dev) for i in live]
    ids = torch.tensor(
        [[rows[i].tokens[-1], *d] for i, d in zip(live, drafts, strict=True)], device=dev
    )
    span = torch.arange(num_steps + 1, device=dev)
    pos = torch.tensor([rows[i].verified for i in live], device=dev)[:, None] + span
    past = mask.shape[1]
    mask = torch.cat([mask, torch.ones_like(ids, dtype=torch.bool)], dim=1)
    logits, aux = target.forward(ids, pos, mask, cache, drafter is not None)
    for j, (i, d) in enumerate(zip(live, drafts, strict=True)):
        row = rows[i]
        n, nxt = _verify(logits[j], d, sampling)
        mask[j, past + n + 1 :] = False  # the rejected proposals' slots
        new = [*d[:n], nxt]
        if drafter is not None:
            row.cache.crop(row.verified)
            p = torch.arange(row.verified, row.verified + n + 1, device=dev)
            feats = drafter.features(aux[j : j + 1, : n + 1].to(drafter.fc.weight.dtype))
            h = drafter.step(feats, torch.tensor([new], device=dev), p, row.cache)
            row.last = h[:, -1:]
        row.accepted.append(n)
        row.verified += n + 1
        row.tokens += new
    return mask


def _verify(logits: Tensor, drafts: list[int], sampling: Sampling | None) -> tuple[int, int]:
    """(proposals accepted, the target's token after them) for one row's chain, the target's
    `logits` [K + 1, V] at the verified token and each proposal: the longest prefix equal to
    its argmax, or the rejection rule when sampling."""
    if sampling is not None:
        return sampling.accept(sampling.probs(logits), drafts)
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def _chain(drafter: Drafter | None, row: _Row, num_steps: int, dev) -> list[int]:
    """The drafter's chain of `num_steps` argmax proposals (target ids) from the row's last
    verified position."""
    if drafter is None:
        return []
    last, drafts = row.last, []
    for k in range(num_steps):  # position verified - 1 + k reads draft k - 1
        draft = drafter.to_target(drafter.logits(last).reshape(-1).argmax(-1, keepdim=True))
        drafts.append(int(draft))
        if k + 1 < num_steps:
            p = torch.tensor([row.verified + k], device=dev)
            last = drafter.step(last, draft.reshape(1, 1), p, row.cache)
    return drafts


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
