"""The evaluate stage's run: the drafter and target loaded, every suite measured, the
metrics folder (metrics.json, plots) and its sidecar written."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

from eaglet.atomic import atomic_path
from eaglet.engines.vllm.generate import target_stop_ids
from eaglet.errors import EagletError
from eaglet.formats.chat import stop_ids
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import write_json
from eaglet.formats.metrics import (
    EngineInfo,
    Metrics,
    Run,
    Suite,
    steps_key,
    summary_json,
    write_metrics,
)
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model import speculative
from eaglet.model.drafter import Drafter
from eaglet.model.target import (
    load_head,
    load_model,
    load_tokenizer,
    materialize,
    pick_device,
)
from eaglet.stages.evaluate import suites
from eaglet.stages.evaluate.engine import engine_export, engine_metrics
from eaglet.stages.evaluate.kernel import (
    DFLASH_NOTE,
    NOTES,
    agreement,
    decode_all,
    heldout_prompts,
    offline,
    settings,
    summary,
)
from eaglet.stages.evaluate.spec import EvaluateSpec, Setup
from eaglet.stages.hidden import read as hidden_read


def lines(metrics: Metrics) -> list[tuple[str, str, Run]]:
    """(suite, label, one run) of every speculative run: the engine's per temperature and
    eaglet's own, each num_steps."""
    out = []
    for suite, m in metrics.suites.items():
        for who, runs in (("vLLM", m.vllm or {}), ("eaglet", m.eaglet)):
            for t, by_steps in runs.items():
                out += [(suite, f"{who} t={t:g} {steps_key(n)}", r) for n, r in by_steps.items()]
    return out


def plot(metrics: Metrics, train_rows: list[dict], folder: Path) -> None:
    """acceptance.png (per draft position), suites.png (acceptance length per suite and
    temperature) and loss.png (training loss and accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = lines(metrics)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for suite, label, m in runs:
        rates, al = m.acceptance_rate, m.acceptance_length or 0.0
        style = ("o-" if "vLLM" in label else "x--") if " t=0 " in label else "s:"
        ax.plot(range(1, len(rates) + 1), rates, style, label=f"{suite} {label}: AL {al:.2f}")
    for n, m in metrics.offline.items():
        rates = m.acceptance_rate
        ax.plot(range(1, len(rates) + 1), rates, "+--", alpha=0.6, label=f"offline {steps_key(n)}")
    ax.set(xlabel="draft position", ylabel="acceptance rate (given the previous accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(f"{metrics.drafter}: acceptance per position")
    fig.tight_layout()
    fig.savefig(folder / "acceptance.png", dpi=100)
    plt.close(fig)

    suites = list(metrics.suites)
    labels = list(dict.fromkeys(label for _, label, _ in runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = {s: m.acceptance_length or 0.0 for s, lab, m in runs if lab == label}
        xs = [j + i * width for j in range(len(suites))]
        bars = ax.bar(xs, [values.get(s, 0.0) for s in suites], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(suites))], suites)
    ax.set(ylabel="acceptance length (bonus token included)", ylim=(1, None))
    ax.set_title(f"{metrics.drafter}: acceptance length per suite")
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
) -> tuple[dict[str, Suite], EngineInfo | None]:
    """Every suite decoded by the engine (if configured) and by eaglet (if the target is loaded
    here, `target_model`): the per-suite metrics, and the engine that measured."""
    cfg, method = settings(spec, setup)
    tokenizer = load_tokenizer(setup.target)
    if target_model is not None:
        stop = set(stop_ids(tokenizer, target_model))
    else:
        stop = set(target_stop_ids(tokenizer, materialize(setup.target)))
    own_split = [] if setup.suites else heldout_prompts(readers, held, cfg.prompts)
    modes = suites.modes(cfg.thinking_switch, cfg.modes)
    prompts = suites.prompts(setup.suites, spec.name, readers, tokenizer, own_split, modes)
    for name, p in prompts.items():
        if not p:
            raise EagletError(f"drafters.{spec.name}: suite {name}: no prompts to decode")
    info, engine = (
        engine_metrics(spec, setup, prompts, stop, cfg, method)
        if cfg.engine == "vllm"
        else (None, {})
    )
    target = target_model and speculative.Target(target_model, list(model.cfg.aux_layer_ids))
    sources = {s.name: s.label for s in setup.suites} or {
        suites.OWN_SPLIT: f"drafters.{spec.name}: held-out split of its datasets"
    }
    out = {}
    for name, p in prompts.items():
        e = engine.get(name)
        ref = e.greedy_outputs if e else None
        own = {
            t: decode_all(
                target, model, p, cfg, stop, setup.quiet, ref, f"evaluate {name} t={t:g}", t
            )
            for t in (cfg.temperatures if target else ())
        }
        suite, _, mode = name.partition("/")
        agreed = agreement(own[0], e.runs[0]) if e and 0 in e.runs and own and ref else None
        out[name] = Suite(
            prompts=len(p),
            source=sources[suite],
            eaglet=own,
            vllm=e.runs if e else None,
            vllm_greedy_tokens_per_s=e.greedy_tokens_per_s if e else None,
            agreement=agreed,
            mode=mode or None,
        )
    return out, info


def setup(
    keys: Keys, spec: Spec[EvaluateSpec], threads: int | None = None, quiet: bool = False
) -> Setup:
    if threads:
        torch.set_num_threads(threads)
    params, drafter = keys.params, spec.name
    cfg = params.drafter(drafter)["evaluate"]
    return Setup(
        hidden_read.states(params, drafter),
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
    if dflash and cfg.engine != "vllm":  # eaglet's own decoder drafts EAGLE-3 chains only
        raise EagletError(
            f"drafters.{spec.name}.method: dflash: evaluate measures a DFlash drafter on vLLM "
            f"only; set drafters.{spec.name}.evaluate.engine: vllm"
        )
    own_decoder = cfg.in_process and not dflash
    if cfg.engine == "vllm" and not setup.engine_url:
        engine_export(spec, setup)  # before decoding: fail fast
    readers = hidden_read.open_readers(setup.states)
    _, held = hidden_read.split(readers, spec.values.heldout_fraction)
    model = None if dflash else load_drafter(setup.trained)
    if dflash:  # the engine alone measures it: no target, no offline estimate here
        target_model = lm_head = None
    elif own_decoder:
        target_model = load_model(setup.target, setup.device, cfg.dtype)
        lm_head = target_model.lm_head.weight
    else:  # the engine decodes; the offline estimate needs only the lm_head
        target_model = None
        lm_head = load_head(setup.target)[1].to(pick_device(setup.device))
    if model is not None:
        model.to(lm_head.device)
    t0 = time.monotonic()
    per_suite, engine = measure_suites(spec, setup, model, target_model, readers, held)
    reference = engine is not None and not engine.operator
    estimate = {} if dflash else offline(model, readers, held, lm_head, list(cfg.num_steps))
    hidden_read.close_readers(readers)  # an online reader's engine
    metrics = Metrics(
        drafter=spec.name,
        prompts=sum(m.prompts for m in per_suite.values()),
        temperatures=tuple(cfg.temperatures),
        greedy_reference="vllm" if reference else ("eaglet" if own_decoder else None),
        in_process=own_decoder,
        suites=per_suite,
        offline=estimate,
        engine=engine,
        # EAGLE-3's metrics keep their bytes: the method and its note are DFlash's alone
        notes=(NOTES | {"dflash": DFLASH_NOTE}) if dflash else NOTES,
        elapsed_s=round(time.monotonic() - t0, 2),
        method="dflash" if dflash else None,
    )
    with open(setup.trained / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with atomic_path(out, directory=True) as tmp:
        write_metrics(tmp / "metrics.json", metrics)
        plot(metrics, rows, tmp)
        stats = summary(metrics, list(cfg.num_steps))
        if dflash:
            stats = stats.dflash(cfg.num_steps[0], DFLASH_NOTE)
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": summary_json(stats)})
    return out
