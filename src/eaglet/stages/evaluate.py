"""The evaluate stage: how many tokens the target accepts per verification with this drafter.

Per suite (eaglet.stages.suites: the natural held-out prompts, HumanEval, any prompt file a user
names), real greedy chain speculative decoding (eaglet.model.speculative) of the target for each
`num_steps`: acceptance length (generated tokens / verification rounds, bonus token included, as
SGLang counts), acceptance per draft position, and the check that every output equals plain
greedy decoding of the target; and at each sampled temperature, speculative sampling (the
rule the engines serve with: argmax proposals, the standard rejection rule). Also a fast offline
estimate from the drafter's held-out hidden states: the teacher-forced chain from every
assistant position (what chain decoding would accept there, without running the target). With
`engine: vllm`, every suite is run by vLLM serving the target with the drafter's vLLM export
(eaglet.stages.engine_eval) first, greedy and at each sampled temperature; the engine's plain greedy
text is then the reference both greedy speculative outputs must equal (eaglet does not decode it
again), and the engine's mean acceptance length is the headline, stated next to eaglet's own.
Writes metrics.json and PNG plots: acceptance per position, per suite and temperature, and the
training loss.
"""

from __future__ import annotations

import csv
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.engines.vllm import ServeConfig, target_stop_ids
from eaglet.errors import EagletError
from eaglet.formats.atomic import atomic_path
from eaglet.formats.chat import stop_ids
from eaglet.formats.dflash import DFLASH_CONFIG, is_dflash
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import write_json
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model import speculative, ttt
from eaglet.model.drafter import Drafter
from eaglet.model.target import (
    TargetSpec,
    load_head,
    load_model,
    load_tokenizer,
    materialize,
    pick_device,
)
from eaglet.model.target_head import TargetHead
from eaglet.progress import Progress
from eaglet.stages import drafter_data, engine_eval, suites
from eaglet.stages.engine_eval import temperature_key
from eaglet.stages.evaluate_spec import EvaluateSpec


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
) -> dict:
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
        out[f"num_steps_{s}"] = {
            "acceptance_length": float(1 + kept.float().mean()) if len(n) else None,
            "acceptance_rate": [
                reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, s + 1)
            ],
            "positions": len(n),
        }
    return out


def decode_all(
    target,
    model,
    prompts,
    cfg: dict,
    stop: set[int],
    quiet: bool,
    reference: list[list[int]] | None = None,
    label: str = "evaluate",
    temperature: float = 0.0,
) -> dict:
    """Speculative decoding of every prompt for each num_steps. Greedy (temperature 0): each
    output checked against plain greedy decoding, `reference` (the engine's greedy outputs, when
    it ran) or eaglet's own. Sampled: speculative sampling seeded by `seed` + num_steps."""
    steps, max_new = cfg["num_steps"], cfg["max_new_tokens"]
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
            g = torch.Generator().manual_seed(cfg["seed"] + s)
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
        out[f"num_steps_{s}"] = m
    return out


def engine_export(spec: Spec, setup: Setup) -> Path:
    """The drafter's current vLLM export, which `engine: vllm` serves."""
    if not setup.export.is_dir():
        raise EagletError(
            f"drafters.{spec.name}.evaluate.engine: vllm needs the vLLM export {setup.export} "
            f"(run: eaglet export {spec.name} --to vllm)"
        )
    return setup.export


def settings(spec: Spec, setup: Setup) -> tuple[dict, str]:
    """evaluate's settings and the drafter's method (vLLM's name: eagle3 or dflash). A DFlash
    drafter drafts block_size - 1 tokens a round: that is its one num_steps, whatever
    evaluate.num_steps lists."""
    from eaglet.formats.io import read_json

    cfg = spec.values.evaluate
    if not is_dflash(setup.trained):
        return cfg, "eagle3"
    block = read_json(setup.trained / DFLASH_CONFIG)["block_size"]
    return dict(cfg, num_steps=[block - 1]), "dflash"


def engine_metrics(
    spec: Spec,
    setup: Setup,
    prompts: dict[str, list[list[int]]],
    stop: set[int],
    cfg: dict,
    method: str = "eagle3",
) -> dict:
    """Every suite run by vLLM serving the target with the drafter's vLLM export (started here),
    or by an operator's engine already serving it (`engine_url`). `cfg`: `settings`'s."""
    target = setup.target
    if setup.engine_url:  # an operator's engine, already serving this drafter
        return engine_eval.measure_running(
            setup.engine_url, target.name, prompts, cfg, sorted(stop)
        )
    longest = max(len(p) for ps in prompts.values() for p in ps) + cfg["max_new_tokens"]
    serve = ServeConfig.of(
        target,
        served_name=target.name,
        dtype=cfg["dtype"],
        max_model_len=max(setup.target_max_length, longest),
        max_num_seqs=cfg["engine_concurrency"],
        enforce_eager=cfg["engine_eager"],
        tensor_parallel_size=cfg["engine_tensor_parallel_size"],
        threads=setup.threads or 0,
        extra_args=tuple(cfg["engine_extra_args"]),
    )
    export = engine_export(spec, setup)
    return engine_eval.measure(serve, export, prompts, cfg, sorted(stop), method=method)


# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.evaluate:prompt_of",
        "eaglet.stages.evaluate:heldout_prompts",
        "eaglet.stages.evaluate:offline",
        "eaglet.stages.evaluate:decode_all",
        "eaglet.stages.evaluate:settings",
        "eaglet.stages.evaluate:engine_metrics",
        "eaglet.stages.evaluate:agreement",
        "eaglet.stages.evaluate:measure_suites",
        "eaglet.stages.evaluate:summary",
        "eaglet.model.speculative",
        "eaglet.model.drafter",
        "eaglet.model.target_head",
        "eaglet.stages.engine_eval:temperature_key",
        "eaglet.stages.engine_eval:measure",
        "eaglet.stages.engine_eval:_speculative",
        "eaglet.stages.suites:humaneval_records",
        "eaglet.stages.suites:prompts",
        "eaglet.stages.drafter_data:is_heldout",
        "eaglet.stages.drafter_data:split",
        "eaglet.engines.vllm:spec_counters",
        "eaglet.engines.vllm:SpecCounters",
        "eaglet.engines.vllm:eagle3",
        "eaglet.engines.vllm:dflash",
        "eaglet.engines.vllm_plugin",
        "eaglet.formats.drafter:load_drafter",
        "eaglet.model.ttt:Run",
        "eaglet.model.ttt:step_masks",
        "eaglet.model.ttt:prepare",
        "eaglet.model.ttt:chain_accepted",
        "eaglet.model.ttt:accepted_counts",
        "eaglet.model.ttt:collate",
        "eaglet.model.ttt:load",
    ),
)

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


def agreement(own: dict, engine: dict) -> dict:
    """How the engine's greedy numbers agree with eaglet's: the same quantity (1 + accepted
    drafts / verification rounds) on the same prompts, each checked against the engine's greedy
    text (NOTES["agreement"])."""
    out: dict = {}
    for name, m in own.items():
        ours, theirs = m["mean_acceptance_length"], engine[name]["acceptance_length"]
        diff = theirs - ours if ours is not None and theirs is not None else None
        out[name] = {
            "engine": theirs,
            "eaglet": ours,
            "difference": diff,
            "eaglet_greedy_equal": m["greedy_equal"],
            "engine_greedy_equal": engine[name]["greedy_equal"],
        }
    return out


def lines(metrics: dict) -> list[tuple[str, str, dict]]:
    """(suite, label, metrics of one run) of every speculative run: the engine's per temperature
    and eaglet's own, each num_steps."""
    out = []
    for suite, m in metrics["suites"].items():
        for tkey, runs in (m.get("vllm") or {}).items():
            t = tkey.removeprefix("temperature_")
            out += [(suite, f"vLLM t={t} {n}", r) for n, r in runs.items()]
        for tkey, runs in m["eaglet"].items():
            t = tkey.removeprefix("temperature_")
            out += [(suite, f"eaglet t={t} {n}", r) for n, r in runs.items()]
    return out


def plot(metrics: dict, train_rows: list[dict], folder: Path) -> None:
    """acceptance.png (per draft position), suites.png (acceptance length per suite and
    temperature) and loss.png (training loss and accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = lines(metrics)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for suite, label, m in runs:
        rates, al = m["acceptance_rate"], m["acceptance_length"] or 0.0
        style = ("o-" if "vLLM" in label else "x--") if " t=0 " in label else "s:"
        ax.plot(range(1, len(rates) + 1), rates, style, label=f"{suite} {label}: AL {al:.2f}")
    for name, m in metrics["offline"].items():
        rates = m["acceptance_rate"]
        ax.plot(range(1, len(rates) + 1), rates, "+--", alpha=0.6, label=f"offline {name}")
    ax.set(xlabel="draft position", ylabel="acceptance rate (given the previous accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(f"{metrics['drafter']}: acceptance per position")
    fig.tight_layout()
    fig.savefig(folder / "acceptance.png", dpi=100)
    plt.close(fig)

    suites = list(metrics["suites"])
    labels = list(dict.fromkeys(label for _, label, _ in runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = {s: m["acceptance_length"] or 0.0 for s, lab, m in runs if lab == label}
        xs = [j + i * width for j in range(len(suites))]
        bars = ax.bar(xs, [values.get(s, 0.0) for s in suites], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(suites))], suites)
    ax.set(ylabel="acceptance length (bonus token included)", ylim=(1, None))
    ax.set_title(f"{metrics['drafter']}: acceptance length per suite")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "suites.png", dpi=100)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [int(r["step"]) for r in train_rows]
    a1.plot(steps, [float(r["loss"]) for r in train_rows])
    a1.set(xlabel="step", ylabel="weighted TTT loss", title="training loss")
    for c in [c for c in train_rows[0] if c.startswith("acc_")] if train_rows else []:
        a2.plot(steps, [float(r[c]) for r in train_rows], label=f"step {c.removeprefix('acc_')}")
    a2.set(xlabel="step", ylabel="top-1 accuracy", title="training accuracy per TTT step")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=100)
    plt.close(fig)


def measure_suites(
    spec: Spec,
    setup: Setup,
    model: Drafter | None,
    target_model: torch.nn.Module | None,
    readers: list,
    held: list,
) -> tuple[dict, dict | None]:
    """Every suite decoded by the engine (if configured) and by eaglet (if the target is loaded
    here, `target_model`): the per-suite metrics."""
    cfg, method = settings(spec, setup)
    tokenizer = load_tokenizer(setup.target)
    if target_model is not None:
        stop = set(stop_ids(tokenizer, target_model))
    else:
        stop = set(target_stop_ids(tokenizer, materialize(setup.target)))
    own_split = [] if setup.suites else heldout_prompts(readers, held, cfg["prompts"])
    modes = suites.modes(cfg.get("thinking_switch"), cfg.get("modes"))
    prompts = suites.prompts(setup.suites, spec.name, readers, tokenizer, own_split, modes)
    for name, p in prompts.items():
        if not p:
            raise EagletError(f"drafters.{spec.name}: suite {name}: no prompts to decode")
    engine = (
        engine_metrics(spec, setup, prompts, stop, cfg, method) if cfg["engine"] == "vllm" else None
    )
    target = target_model and speculative.Target(target_model, list(model.cfg.aux_layer_ids))
    sources = {s.name: s.label for s in setup.suites} or {
        suites.OWN_SPLIT: f"drafters.{spec.name}: held-out split of its datasets"
    }
    out = {}
    for name, p in prompts.items():
        e = engine["suites"][name] if engine else None
        ref = e.pop("greedy_outputs") if e else None
        own = {
            temperature_key(t): decode_all(
                target, model, p, cfg, stop, setup.quiet, ref, f"evaluate {name} t={t:g}", t
            )
            for t in (cfg["temperatures"] if target else [])
        }
        suite, _, mode = name.partition("/")
        out[name] = {"prompts": len(p), "source": sources[suite], "eaglet": own}
        if mode:
            out[name]["mode"] = mode
        if e:
            out[name]["vllm_greedy_tokens_per_s"] = e.pop("greedy_tokens_per_s")
            out[name]["vllm"] = e
            if "temperature_0" in e and own and ref:
                out[name]["agreement"] = agreement(own["temperature_0"], e["temperature_0"])
    return out, ({k: v for k, v in engine.items() if k != "suites"} if engine else None)


@dataclass(frozen=True)
class Setup:
    """Beside the spec: where things are and how the run is placed; changes no output byte."""

    states: drafter_data.States
    trained: Path
    export: Path  # the vLLM export an eaglet-started engine serves
    target: TargetSpec  # where its files are (its identity is in the spec)
    suites: tuple[suites.Suite, ...]
    device: str  # as configured, e.g. cuda:1 (the spec holds its type)
    target_max_length: int  # the engine's context floor
    engine_url: str | None = None  # an operator's engine serving the drafter
    threads: int | None = None
    quiet: bool = False


def setup(
    keys: Keys, spec: Spec[EvaluateSpec], threads: int | None = None, quiet: bool = False
) -> Setup:
    if threads:
        torch.set_num_threads(threads)
    params, drafter = keys.params, spec.name
    cfg = params.drafter(drafter)["evaluate"]
    return Setup(
        drafter_data.states(params, drafter),
        keys.path("train", drafter),
        keys.path("vllm", drafter),
        keys.target,
        suites.configured(params, drafter),
        cfg["device"],
        params.target["max_length"],
        cfg.get("engine_url"),
        threads,
        quiet,
    )


def run(spec: Spec[EvaluateSpec], setup: Setup, out: Path) -> Path:
    """Measure the drafter as `spec` says; write the metrics folder `out` and its sidecar."""
    cfg, method = settings(spec, setup)
    dflash = method == "dflash"
    if dflash and cfg["engine"] != "vllm":  # eaglet's own decoder drafts EAGLE-3 chains only
        raise EagletError(
            f"drafters.{spec.name}.method: dflash: evaluate measures a DFlash drafter on vLLM "
            f"only; set drafters.{spec.name}.evaluate.engine: vllm"
        )
    own_decoder = cfg["in_process"] and not dflash
    if cfg["engine"] == "vllm" and not setup.engine_url:
        engine_export(spec, setup)  # before decoding: fail fast
    readers = drafter_data.open_readers(setup.states)
    _, held = drafter_data.split(readers, spec.values.heldout_fraction)
    model = None if dflash else load_drafter(setup.trained)
    if dflash:  # the engine alone measures it: no target, no offline estimate here
        target_model = lm_head = None
    elif own_decoder:
        target_model = load_model(setup.target, setup.device, cfg["dtype"])
        lm_head = target_model.lm_head.weight
    else:  # the engine decodes; the offline estimate needs only the lm_head
        target_model = None
        lm_head = load_head(setup.target)[1].to(pick_device(setup.device))
    if model is not None:
        model.to(lm_head.device)
    t0 = time.monotonic()
    per_suite, engine = measure_suites(spec, setup, model, target_model, readers, held)
    reference = engine is not None and not engine.get("operator")
    metrics = {
        "drafter": spec.name,
        "prompts": sum(m["prompts"] for m in per_suite.values()),
        "temperatures": cfg["temperatures"],
        "greedy_reference": "vllm" if reference else ("eaglet" if own_decoder else None),
        "in_process": own_decoder,
        "suites": per_suite,
        "offline": {} if dflash else offline(model, readers, held, lm_head, cfg["num_steps"]),
        "engine": engine,
        "notes": NOTES,
    }
    if dflash:  # EAGLE-3's metrics keep their bytes: these keys are DFlash's alone
        metrics["method"] = "dflash"
        metrics["notes"] = NOTES | {"dflash": DFLASH_NOTE}
    drafter_data.close_readers(readers)  # an online reader's engine
    metrics["elapsed_s"] = round(time.monotonic() - t0, 2)
    with open(setup.trained / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with atomic_path(out, directory=True) as tmp:
        write_json(tmp / "metrics.json", metrics)
        plot(metrics, rows, tmp)
        stats = summary(metrics, cfg["num_steps"])
        if dflash:
            stats |= {"method": "dflash", "num_steps": cfg["num_steps"][0], "note": DFLASH_NOTE}
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
    return out


def summary(metrics: dict, num_steps: list[int]) -> dict:
    """The headline numbers: acceptance length at the fewest steps on the first suite (the
    engine's greedy one when it ran, else eaglet's), and per suite the engine's acceptance
    length per temperature, eaglet's own and its greedy equality, per num_steps; the offline
    estimate."""
    first = f"num_steps_{min(num_steps)}"
    engine = metrics["engine"] is not None
    runs = next(iter(metrics["suites"].values()))["vllm" if engine else "eaglet"]
    greedy = runs.get(temperature_key(0)) or next(iter(runs.values()))
    headline = greedy[first]["acceptance_length"]
    per_suite = {}
    for name, m in metrics["suites"].items():
        row: dict = {"prompts": m["prompts"]}
        for t, runs in (m.get("vllm") or {}).items():
            row[f"vllm_{t}"] = {n: r["acceptance_length"] for n, r in runs.items()}
        for t, runs in m["eaglet"].items():
            row[f"eaglet_{t}"] = {n: r["acceptance_length"] for n, r in runs.items()}
        greedy = m["eaglet"].get(temperature_key(0), {})
        row["greedy_equal"] = {n: r["greedy_equal"] for n, r in greedy.items()}
        per_suite[name] = row
    return {
        "prompts": metrics["prompts"],
        "acceptance_length": headline,
        "acceptance_length_by": "vllm" if engine else "eaglet",
        "suites": per_suite,
        "offline_acceptance_length": {
            n: m["acceptance_length"] for n, m in metrics["offline"].items()
        },
    }
