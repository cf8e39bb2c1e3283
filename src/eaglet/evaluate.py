"""The evaluate stage: how many tokens the target accepts per verification with this drafter.

Real greedy chain speculative decoding (eaglet.speculative) of the target on held-out prompts
for each `num_steps`: acceptance length (generated tokens / verification rounds, bonus token
included, as SGLang counts), acceptance per draft position, and the check that every output
equals plain greedy decoding of the target. Also a fast offline estimate from the held-out
hidden states: the teacher-forced chain from every assistant position (what chain decoding
would accept there, without running the target). With `engine: vllm`, the same prompts are run by
vLLM serving the target with the drafter's vLLM export (eaglet.engine_eval) first; the engine's
plain greedy text is then the reference both speculative outputs must equal (eaglet does not decode
it again), and the engine's mean acceptance length is the headline, stated next to eaglet's own.
Writes metrics.json and PNG plots of the acceptance per position and of the training loss.
"""

from __future__ import annotations

import csv
import itertools
import time
from pathlib import Path
from typing import Any

import torch

from eaglet import drafter_data, engine_eval, speculative, train
from eaglet.atomic import atomic_path
from eaglet.chat import prompt_ids, stop_ids
from eaglet.drafter import Drafter
from eaglet.engines.vllm import ServeConfig, target_stop_ids
from eaglet.errors import EagletError
from eaglet.io import write_json
from eaglet.keys import Keys, sidecar_of
from eaglet.params import Params
from eaglet.progress import Progress
from eaglet.prompts import collect
from eaglet.target import load_head, load_model, load_tokenizer, materialize, pick_device, spec_of


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


def file_prompts(params: Params, drafter: str, readers: list, tokenizer: Any) -> list[list[int]]:
    """The first `prompts` prompts of `evaluate.heldout_prompts` (file order), as the target
    sees them; none may be a prompt of the drafter's data (sample ids are prompt ids)."""
    d = params.drafter(drafter)
    file = d["evaluate"]["heldout_prompts"]
    source = params.resolve(file["path"])
    records, _ = collect(source, file["format"], "heldout")
    seen = {sid for r in readers for sid in r.ids}
    for rec in records:
        if rec["id"] in seen:
            raise EagletError(
                f"{source}:{rec['source']['line']}: also a prompt of the drafter's datasets "
                f"(drafters.{drafter}.datasets), so not held out"
            )
    return [prompt_ids(tokenizer, r["messages"]) for r in records[: d["evaluate"]["prompts"]]]


@torch.no_grad()
def offline(
    model: Drafter, readers: list, refs: list, lm_head: torch.Tensor, num_steps: list[int]
) -> dict:
    """Acceptance estimated from held-out hidden states: at every start position t whose
    token t+1 is an assistant token, the draft chain is accepted while step k's draft equals
    the target's argmax at t+k+1 and token t+k+2 is still in the response."""
    steps = max(num_steps)
    accepted: list[torch.Tensor] = []
    for i in range(0, len(refs), 4):
        b = drafter_data.load(readers, refs[i : i + 4], 1 << 30)
        b = {k: v.to(lm_head.device) for k, v in b.items()}
        logits = model(b["aux"], b["input_ids"], steps)
        target = (b["last"].float() @ lm_head.float().T).argmax(-1)
        lm = b["loss_mask"]
        run = torch.ones_like(lm)
        count = torch.zeros(lm.shape, dtype=torch.long, device=lm.device)
        for k, lk in enumerate(logits):
            hit = model.to_target(lk.argmax(-1)) == train.shift(target, k + 1)
            run = run & hit & train.shift(lm, k + 2)
            count += run
        start = train.shift(lm, 1) & train.shift(lm, 2)
        accepted.append(count[start].cpu())
    n = torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long)
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
) -> dict:
    """Speculative decoding of every prompt for each num_steps, its output checked against plain
    greedy decoding: `reference` (the engine's greedy outputs, when it ran) or eaglet's own."""
    steps, max_new = cfg["num_steps"], cfg["max_new_tokens"]
    own_greedy = reference is None
    runs_per_prompt = int(own_greedy) + len(steps)
    progress = Progress("evaluate", len(prompts) * runs_per_prompt, quiet=quiet, unit="run")

    def ended(r: speculative.Decoded) -> None:
        progress.update(1, tokens=len(r.tokens))

    seconds, runs = {}, {}
    for s in ([0] if own_greedy else []) + steps:  # 0: plain greedy
        t0 = time.perf_counter()
        runs[s] = speculative.decode(target, prompts, max_new, stop, model if s else None, s, ended)
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
        same = [r.tokens == g for r, g in zip(results, reference, strict=True)]
        tps = m["generated_tokens"] / seconds[s]
        m.update(speculative.against_greedy(same, tps, greedy_tps))
        out[f"num_steps_{s}"] = m
    return out


def engine_export(params: Params, drafter: str) -> Path:
    """The drafter's current vLLM export, which `engine: vllm` serves."""
    export = Keys(params).path("vllm", drafter)
    if not export.is_dir():
        raise EagletError(
            f"drafters.{drafter}.evaluate.engine: vllm needs the vLLM export {export} "
            f"(run: eaglet export {drafter} --to vllm)"
        )
    return export


def engine_metrics(
    params: Params, drafter: str, prompts: list[list[int]], stop: set[int], threads: int | None
) -> dict:
    """The held-out prompts run by vLLM serving the target with the drafter's vLLM export."""
    d = params.drafter(drafter)
    cfg = d["evaluate"]
    spec = spec_of(params)
    if "engine_url" in cfg:  # an operator's engine, already serving this drafter
        return engine_eval.measure_running(
            cfg["engine_url"], spec.name, prompts, cfg["num_steps"][0], cfg["max_new_tokens"],
            sorted(stop), cfg["engine_concurrency"],
        )  # fmt: skip
    export = engine_export(params, drafter)
    longest = max(len(p) for p in prompts) + cfg["max_new_tokens"]
    serve = ServeConfig(
        model=materialize(spec),
        served_name=spec.name,
        dtype=cfg["dtype"],
        max_model_len=max(params.target["max_length"], longest),
        max_num_seqs=cfg["engine_concurrency"],
        enforce_eager=cfg["engine_eager"],
        tensor_parallel_size=cfg["engine_tensor_parallel_size"],
        threads=threads or 0,
        extra_args=tuple(cfg["engine_extra_args"]),
    )
    return engine_eval.measure(
        serve, export, prompts, cfg["num_steps"], cfg["max_new_tokens"], sorted(stop),
        cfg["engine_concurrency"],
    )  # fmt: skip


def agreement(own: dict, engine: dict) -> dict:
    """How the engine's numbers agree with eaglet's: the same quantity (1 + accepted drafts /
    verification rounds) on the same prompts, each checked against the engine's greedy text."""
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
    out["note"] = (
        "both = 1 + accepted drafts / verification rounds on the same held-out prompts "
        "(eaglet's own acceptance_length, tokens / rounds, also counts the prefill token); both "
        "speculative outputs are compared with the engine's plain greedy output (greedy_equal): "
        "where one differs the two decode different text, and elsewhere the gap is the "
        "drafter's bf16 export (eaglet decodes with the fp32 checkpoint) and the engine's kernels"
    )
    return out


def plot(metrics: dict, train_rows: list[dict], folder: Path) -> None:
    """acceptance.png (per draft position) and loss.png (training loss and accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in metrics["speculative"].items():
        rates = m["acceptance_rate"]
        al = m["acceptance_length"] or 0.0
        ax.plot(range(1, len(rates) + 1), rates, "o-", label=f"{name}: AL {al:.2f}")
    for name, m in (metrics.get("engine") or {}).items():
        if name.startswith("num_steps_"):
            rates, al = m["acceptance_rate"], m["acceptance_length"] or 0.0
            ax.plot(range(1, len(rates) + 1), rates, "s:", label=f"vLLM {name}: AL {al:.2f}")
    for name, m in metrics["offline"].items():
        rates = m["acceptance_rate"]
        ax.plot(range(1, len(rates) + 1), rates, "x--", alpha=0.6, label=f"offline {name}")
    ax.set(xlabel="draft position", ylabel="acceptance rate (given the previous accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"{metrics['drafter']}: acceptance per position")
    fig.tight_layout()
    fig.savefig(folder / "acceptance.png", dpi=100)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [int(r["step"]) for r in train_rows]
    a1.plot(steps, [float(r["loss"]) for r in train_rows])
    a1.set(xlabel="step", ylabel="weighted TTT loss", title="training loss")
    for k in range(len([c for c in train_rows[0] if c.startswith("acc_")]) if train_rows else 0):
        a2.plot(steps, [float(r[f"acc_{k}"]) for r in train_rows], label=f"step {k}")
    a2.set(xlabel="step", ylabel="top-1 accuracy", title="training accuracy per TTT step")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=100)
    plt.close(fig)


def build(
    params: Params,
    drafter: str,
    out: Path | None = None,
    threads: int | None = None,
    quiet: bool = False,
) -> Path:
    """Evaluate the current trained drafter; write the metrics folder and its sidecar."""
    if threads:
        torch.set_num_threads(threads)
    keys = Keys(params)
    prov = keys.provenance("evaluate", drafter)  # refuses a target that fits nowhere
    own_decoder = prov["params"]["evaluate"]["in_process"]
    out = Path(out) if out else keys.path("evaluate", drafter)
    d = params.drafter(drafter)
    cfg = d["evaluate"]
    if cfg["engine"] == "vllm" and "engine_url" not in cfg:
        engine_export(params, drafter)  # before decoding: fail fast
    readers = drafter_data.open_readers(params, drafter)
    _, held = drafter_data.split(readers, d["heldout_fraction"])
    trained = keys.path("train", drafter)
    model = train.load(trained)
    spec = spec_of(params)
    tokenizer = load_tokenizer(spec)
    if own_decoder:
        target_model = load_model(spec, cfg["device"], cfg["dtype"])
        stop = set(stop_ids(tokenizer, target_model))
        lm_head = target_model.lm_head.weight
        target = speculative.Target(target_model, list(model.cfg.aux_layer_ids))
    else:  # the engine decodes; the offline estimate needs only the lm_head
        stop = set(target_stop_ids(tokenizer, materialize(spec)))
        lm_head = load_head(spec)[1].to(pick_device(cfg["device"]))
    model.to(lm_head.device)
    if "heldout_prompts" in cfg:
        prompts = file_prompts(params, drafter, readers, tokenizer)
    else:
        prompts = heldout_prompts(readers, held, cfg["prompts"])
    if not prompts:
        raise EagletError(
            f"drafters.{drafter}: no held-out prompts to decode (heldout_fraction "
            f"{d['heldout_fraction']} of {sum(len(r) for r in readers)} samples)"
        )
    t0 = time.monotonic()
    engine = None
    if cfg["engine"] == "vllm":  # first: its greedy outputs are the reference for eaglet's own
        engine = engine_metrics(params, drafter, prompts, stop, threads)
    reference = engine.get("greedy_outputs") if engine else None
    own = decode_all(target, model, prompts, cfg, stop, quiet, reference) if own_decoder else {}
    metrics = {
        "drafter": drafter,
        "prompts": len(prompts),
        "greedy_reference": ("vllm" if reference else None) if engine else "eaglet",
        "in_process": own_decoder,
        "speculative": own,
        "offline": offline(model, readers, held, lm_head, cfg["num_steps"]),
    }
    if engine and own and reference:
        metrics["agreement"] = agreement(own, engine)
    if engine:
        metrics["engine"] = {k: v for k, v in engine.items() if k != "greedy_outputs"}
    metrics["elapsed_s"] = round(time.monotonic() - t0, 2)
    with open(trained / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with atomic_path(out, directory=True) as tmp:
        write_json(tmp / "metrics.json", metrics)
        plot(metrics, rows, tmp)
        write_json(
            sidecar_of(out), {"provenance": prov, "stats": summary(metrics, cfg["num_steps"])}
        )
    return out


def summary(metrics: dict, num_steps: list[int]) -> dict:
    """The headline numbers: acceptance length at the fewest steps (the engine's when it ran,
    else eaglet's), per num_steps eaglet's own, the engine's and the offline estimate, and
    greedy equality."""
    engine = metrics.get("engine")
    source = engine or metrics["speculative"]
    first = f"num_steps_{min(num_steps)}"
    out = {
        "prompts": metrics["prompts"],
        "acceptance_length": source[first]["acceptance_length"],
        "acceptance_length_by": "vllm" if engine else "eaglet",
    }
    for name in (f"num_steps_{s}" for s in num_steps):
        m = metrics["speculative"].get(name)
        if m:
            out[f"acceptance_length_{name}"] = m["acceptance_length"]
            out[f"greedy_equal_{name}"] = m["greedy_equal"]
        out[f"offline_acceptance_length_{name}"] = metrics["offline"][name]["acceptance_length"]
        if engine:
            out[f"vllm_acceptance_length_{name}"] = engine[name]["acceptance_length"]
            out[f"vllm_tokens_per_s_{name}"] = engine[name]["tokens_per_s"]
            out[f"vllm_greedy_equal_{name}"] = engine[name]["greedy_equal"]
        if engine and m:
            out[f"eaglet_mean_acceptance_length_{name}"] = m["mean_acceptance_length"]
    if engine:
        out["vllm_greedy_tokens_per_s"] = engine["greedy_tokens_per_s"]
    return out
