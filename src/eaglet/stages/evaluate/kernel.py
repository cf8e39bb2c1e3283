"""What decides the metrics' bytes: the prompts of the held-out split, eaglet's own decoding
and offline estimate, the evaluate settings, the agreement with the engine, the summary."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from eaglet.formats.dflash import DFLASH_CONFIG, is_dflash
from eaglet.formats.metrics import (
    Agreement,
    Metrics,
    Offline,
    Run,
    SuiteSummary,
    Summary,
    run_of,
)
from eaglet.graph.keys import Spec
from eaglet.model import speculative, ttt
from eaglet.model.drafter import Drafter
from eaglet.model.target_head import TargetHead
from eaglet.progress import Progress

if TYPE_CHECKING:
    from eaglet.stages.evaluate.spec import EvaluateSettings, Setup


def prompt_of(sample: dict) -> list[int] | None:
    """The prompt ids of a sample: everything before its first assistant token."""
    first = sample["loss_mask"].nonzero()
    return sample["input_ids"][: int(first[0])].tolist() if len(first) else None


def heldout_prompts(readers: list, held: list, n: int) -> list[list[int]]:
    """Up to n held-out prompts, taken from the drafter's datasets in turn."""
    per_dataset = [[sid for i, sid in held if i == r] for r in range(len(readers))]
    turns = itertools.chain.from_iterable(itertools.zip_longest(*per_dataset))
    ordered = [(r % len(readers), sid) for r, sid in enumerate(turns)]
    prompts = (prompt_of(readers[r].get(sid)) for r, sid in ordered if sid is not None)
    return list(itertools.islice((p for p in prompts if p is not None), n))


@torch.no_grad()
def offline(
    model: Drafter, readers: list, refs: list, lm_head: torch.Tensor, num_steps: list[int]
) -> dict[int, Offline]:
    """Acceptance estimated from held-out hidden states: at every start position t whose
    token t+1 is an assistant token, the draft chain is accepted while step k's draft equals
    the target's argmax at t+k+1 and token t+k+2 is still in the response. Training's
    measure (ttt.chain_accepted) over whole samples: logits go in chunks, so a 32K-token
    sample never holds a [T, vocab] tensor."""
    run = ttt.Run("float32", lm_head.device.type)
    head = TargetHead(lm_head, model.t2d.to(lm_head.device)).to(lm_head.device)
    n = ttt.accepted_counts(model, readers, refs, head, max(num_steps), run, 4, 1 << 30)
    out = {}
    for s in num_steps:
        kept = n.clamp(max=s)
        reached = [int((kept >= i).sum()) for i in range(s + 1)]
        out[s] = Offline(
            acceptance_length=float(1 + kept.float().mean()) if len(n) else None,
            acceptance_rate=tuple(
                reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, s + 1)
            ),
            positions=len(n),
        )
    return out


def decode_all(
    target,
    model,
    prompts,
    cfg: EvaluateSettings,
    stop: set[int],
    quiet: bool,
    reference: list[list[int]] | None = None,
    label: str = "evaluate",
    temperature: float = 0.0,
) -> dict[int, Run]:
    """Speculative decoding of every prompt for each num_steps. Greedy (temperature 0): each
    output checked against plain greedy decoding, `reference` (the engine's greedy outputs, when
    it ran) or eaglet's own. Sampled: speculative sampling seeded by `seed` + num_steps."""
    steps, max_new = list(cfg.num_steps), cfg.max_new_tokens
    sampled = temperature > 0
    own_greedy = reference is None and not sampled
    runs_per_prompt = int(own_greedy) + len(steps)
    progress = Progress(label, len(prompts) * runs_per_prompt, quiet=quiet, unit="run")

    def ended(r: speculative.Decoded) -> None:
        progress.update(1, tokens=len(r.tokens))

    seconds, runs = {}, {}
    for s in ([0] if own_greedy else []) + steps:  # 0: plain greedy
        sampling = None
        if sampled:
            g = torch.Generator().manual_seed(cfg.seed + s)
            sampling = speculative.Sampling(temperature, g)
        t0 = time.perf_counter()
        runs[s] = speculative.decode(
            target, prompts, max_new, stop, model if s else None, s, ended, sampling
        )
        seconds[s] = time.perf_counter() - t0
    progress.close()
    greedy_tps = None
    if own_greedy:
        plain = runs.pop(0)
        reference = [r.tokens for r in plain]
        greedy_tps = sum(len(r.tokens) for r in plain) / seconds[0]
    out = {}
    for s, results in runs.items():
        m = speculative.acceptance(results, s)
        tps = m["generated_tokens"] / seconds[s]
        if sampled:
            m["tokens_per_s"] = round(tps, 2)
        else:
            same = [r.tokens == g for r, g in zip(results, reference, strict=True)]
            m.update(speculative.against_greedy(same, tps, greedy_tps))
        out[s] = run_of(m, f"eaglet's run at num_steps {s}")
    return out


def settings(spec: Spec, setup: Setup) -> tuple[EvaluateSettings, str]:
    """evaluate's settings and the drafter's method (vLLM's name: eagle3 or dflash). A DFlash
    drafter drafts block_size - 1 tokens a round: that is its one num_steps, whatever
    evaluate.num_steps lists."""
    from eaglet.formats.io import read_json

    cfg = spec.values.settings
    if not is_dflash(setup.trained):
        return cfg, "eagle3"
    block = read_json(setup.trained / DFLASH_CONFIG)["block_size"]
    return replace(cfg, num_steps=(block - 1,)), "dflash"


NOTES = {
    "agreement": (
        "both = 1 + accepted drafts / verification rounds on the same prompts, greedy "
        "(eaglet's own acceptance_length, tokens / rounds, also counts the prefill token); both "
        "speculative outputs are compared with the engine's plain greedy output (greedy_equal): "
        "where one differs the two decode different text, and elsewhere the gap is the "
        "drafter's bf16 export (eaglet decodes with the fp32 checkpoint) and the engine's kernels"
    ),
    "eaglet": (
        "eaglet's own decoder: greedy chain decoding checked token for token against plain "
        "greedy; sampled, the rejection rule vLLM and SGLang serve with, on the drafter's argmax "
        "proposals (eaglet.model.speculative.Sampling), seeded by seed + num_steps"
    ),
    "sampled": (
        "temperature > 0: vLLM's speculative sampling (rejection sampling against the drafter's "
        "proposals; output distributed as the target's), request i seeded with seed + i; one "
        "sample per prompt, so the number carries sampling noise; vLLM's CPU build verifies "
        "through eaglet's vLLM plugin (eaglet.engines.vllm_plugin)"
    ),
}


DFLASH_NOTE = (
    "method dflash: vLLM serves the drafter's export with num_speculative_tokens = block_size - "
    "1 (its one num_steps; evaluate.num_steps does not apply); eaglet's own decoder does not "
    "draft DFlash blocks yet, so there is no eaglet run, no agreement and no offline estimate"
)


def agreement(own: dict[int, Run], engine: dict[int, Run]) -> dict[int, Agreement]:
    """How the engine's greedy numbers agree with eaglet's, per num_steps: the same quantity (1 +
    accepted drafts / verification rounds) on the same prompts, each checked against the
    engine's greedy text (NOTES["agreement"])."""
    out = {}
    for n, m in own.items():
        ours, theirs = m.rounds.mean_acceptance_length, engine[n].acceptance_length
        diff = theirs - ours if ours is not None and theirs is not None else None
        out[n] = Agreement(
            engine=theirs,
            eaglet=ours,
            difference=diff,
            eaglet_greedy_equal=m.greedy.greedy_equal,
            engine_greedy_equal=engine[n].greedy.greedy_equal,
        )
    return out


def _lengths(runs: dict[float, dict[int, Run]]) -> dict[float, dict[int, float | None]]:
    return {t: {n: r.acceptance_length for n, r in by.items()} for t, by in runs.items()}


def summary(metrics: Metrics, num_steps: list[int]) -> Summary:
    """The headline numbers: acceptance length at the fewest steps on the first suite (the
    engine's greedy one when it ran, else eaglet's), and per suite the engine's acceptance
    length per temperature, eaglet's own and its greedy equality, per num_steps; the offline
    estimate."""
    engine = metrics.engine is not None
    first = next(iter(metrics.suites.values()))
    runs = first.vllm if engine else first.eaglet
    greedy = runs.get(0) or next(iter(runs.values()))
    per_suite = {
        name: SuiteSummary(
            prompts=m.prompts,
            eaglet=_lengths(m.eaglet),
            vllm=_lengths(m.vllm or {}),
            greedy_equal={n: r.greedy.greedy_equal for n, r in m.eaglet.get(0, {}).items()},
        )
        for name, m in metrics.suites.items()
    }
    return Summary(
        prompts=metrics.prompts,
        acceptance_length=greedy[min(num_steps)].acceptance_length,
        acceptance_length_by="vllm" if engine else "eaglet",
        suites=per_suite,
        offline_acceptance_length={n: m.acceptance_length for n, m in metrics.offline.items()},
    )
