"""The run stage by stage for `eaglet plan`: where each stage runs, what it needs, how long.

One row per stage: generation per dataset, then hidden states, vocab, training, evaluation and
export (per drafter). Each row says where it runs (an API, a server at a URL, a vLLM engine
eaglet starts with tensor parallel N, torchrun x N, this CPU), the GPU memory one device needs
(the target's weights / tensor parallel + the KV cache of the sequences in flight, as
eaglet.graph.footprint counts it), disk, dollars, and the time at the rates of `plan:` (params).

- Engines on the node: GPU memory = weights / TP + KV of `concurrency` sequences of the longest
  length; it must fit ENGINE_FRACTION of a GPU (vLLM's default gpu_memory_utilization). When the
  weights and one sequence fit but not all in flight, the engine runs fewer at a time (the row
  says how many); when not even one fits: DOES NOT FIT. A server at a URL off this node is the
  operator's to size ("-"); one on loopback is taken to span the node's GPUs.
- Time: generation = answered prompts / requests_per_s, or expected completion tokens /
  completion_tokens_per_s (`plan.rates.<backend>`); hidden = expected tokens /
  prefill_tokens_per_s (+ one engine start when eaglet starts it); training = epochs x
  training tokens / train_tokens_per_s; evaluation = engine starts x engine_startup_s + passes
  x prompts x max_new_tokens / (decode_tokens_per_s x concurrency), where a pass decodes every
  suite's prompts in every mode, and the passes are the target alone plus each step count at
  each temperature. Vocab and export read
  or write one file and take minutes at most: 0.
- Total: API generation overlaps the node's generation (different machines), everything after
  it runs in sequence on the node: max(API generation, node generation) + the rest.
- Online and hybrid hidden states (`colocation`): the trainer asks the engine for states while
  it trains, so each GPU holds both: the engine's weights / TP + the KV of one sequence of the
  longest max_length, plus the largest training peak, against `--gpu-memory`. An engine at a
  URL off this node shares nothing.
- Options (`engine_options`, `training_options`, `colocation_options`): where a row does not
  fit, each single change that would, re-priced by the same arithmetic.
"""

from __future__ import annotations

from urllib.parse import urlparse

from eaglet.graph import footprint
from eaglet.graph.keys import Keys
from eaglet.model import arch, train_memory

ENGINE_FRACTION = 0.9
GB = 1e9  # file sizes as published (554 GB of weights)
GIB = 2**30  # GPU memory, as nvidia-smi shows it and the training check counts it


def _local(url: str) -> bool:
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


def engine_row(text: dict, plan: dict, tp: int, seqs: int, seq_len: int, extra: float = 0):
    """(GiB per GPU: weights, KV per sequence, sequences in flight; verdict) of a target engine
    on `tp` GPUs of `plan.gpu_memory_gb` GiB each."""
    gpus, mem = plan.get("gpus"), plan.get("gpu_memory_gb")
    weights = (weights_bytes(text, plan) + extra) / tp  # a drafter's layers split like the target's
    kv = footprint.kv_bytes_per_token(text, tp) * seq_len
    need = {"weights_gib": weights / GIB, "kv_gib_per_seq": kv / GIB, "seqs": seqs}
    if mem is None or gpus is None:
        return need, "? (plan.gpus, plan.gpu_memory_gb)"
    if tp > gpus:
        return need, f"DOES NOT FIT (TP {tp} > {gpus} GPUs)"
    room = ENGINE_FRACTION * mem * GIB - weights
    if room < kv:
        return need, "DOES NOT FIT"
    held = int(room // kv)
    return need, "fits" if held >= seqs else f"fits {held} of {seqs} in flight"


def weights_bytes(text: dict, plan: dict) -> float:
    """The target's weights as served: `plan.target_weights_gb`, else parameters x 2 bytes."""
    given = plan.get("target_weights_gb")
    return given * GB if given else footprint.parameters(text) * 2


def drafter_parameters(text: dict, resolved: dict, draft_vocab: int) -> tuple[int, int]:
    """(trained parameters, frozen embeddings) of an EAGLE-3 drafter: fc 3H->H, one decoder layer
    on [embedding; hidden] (2H in; Llama or MLA attention), its MLP, the norms, the draft lm_head
    (eaglet.model.train_memory's count); the embeddings are the target's."""
    h, vocab = text["hidden_size"], text["vocab_size"]
    shape = train_memory.Shape.of(resolved, h, vocab, draft_vocab, steps=1)
    return shape.trainable(), vocab * h


def _where_backend(name: str, cfg: dict, gpus: int | None) -> tuple[str, int | None]:
    """(where a generation backend runs, its tensor parallel on this node or None)."""
    kind = cfg["kind"]
    if kind == "openai":
        return f"{name}: {urlparse(cfg['base_url']).hostname} API", None
    if kind == "transformers":
        return f"{name}: in-process ({cfg['device']})", None
    if "url" in cfg:
        tp = gpus if _local(cfg["url"]) else None
        node = f", TP {tp} on this node" if tp else ""
        return f"{name}: {kind} at {cfg['url']}{node}", tp
    tp = cfg["tensor_parallel_size"]
    return f"{name}: vLLM TP {tp} (eaglet starts)", tp


def generation_rows(keys: Keys, rows: list[dict], text: dict) -> list[dict]:
    """One row per dataset from dataset_plan's numbers."""
    p, plan = keys.params, keys.params.data["plan"]
    out = []
    for r in rows:
        ds, name = r["dataset"], r["backend"]
        cfg = p.backend(name)
        where, tp = _where_backend(name, cfg, plan.get("gpus"))
        mem, fits, options = (None, "-", [])
        if tp:
            seqs = cfg.get("concurrency", 1)
            mem, fits = engine_row(text, plan, tp, seqs, r["max_length"])
            options = engine_options(text, plan, fits, tp, seqs, r["max_length"])
        rate = plan["rates"].get(name, {})
        n_exp = r["requests"]["expected"]  # a request per turn
        secs = None
        if "requests_per_s" in rate and n_exp is not None:
            secs = n_exp / rate["requests_per_s"]
        elif "completion_tokens_per_s" in rate and r["completion_tokens"]["expected"]:
            secs = r["completion_tokens"]["expected"] / rate["completion_tokens_per_s"]
        out.append(
            {
                "stage": f"generate {ds}",
                "runs_on": where,
                "node": bool(tp),
                "gpu_gb": mem,
                "fits": fits,
                "disk_bytes": None,
                "cost_usd": r["cost_usd"]["expected"],
                "seconds": secs,
                "options": options,
            }
        )
    return out


def hidden_row(keys: Keys, total: dict, text: dict, disk_fits: dict) -> dict:
    """The hidden-states stage over every dataset: one engine of the target."""
    p = keys.params
    h, plan = p.data["hidden"], p.data["plan"]
    longest = max(map(p.max_length, p.datasets))
    secs = None
    if total["hidden_tokens"]["expected"] is not None:
        secs = total["hidden_tokens"]["expected"] / plan["prefill_tokens_per_s"]
    tp = hidden_tp(h, plan)
    if h["backend"] == "transformers":
        where = f"transformers in-process ({h['device']})"
    elif h.get("url"):
        where = f"{h['backend']} at {h['url']}" + (f", TP {tp} on this node" if tp else "")
    else:
        where = f"vLLM TP {tp} (eaglet starts)"
        secs = secs + plan["engine_startup_s"] if secs is not None else None
    mem, fits, options = None, "-", []
    if tp:
        mem, fits = engine_row(text, plan, tp, h["concurrency"], longest)
        options = engine_options(text, plan, fits, tp, h["concurrency"], longest)
    disk = {True: "disk fits", False: "disk DOES NOT FIT", None: "disk ?"}[disk_fits["expected"]]
    return {
        "stage": "hidden states (all datasets)",
        "runs_on": where,
        "node": True,
        "gpu_gb": mem,
        "fits": f"{fits}; {disk}",
        "disk_bytes": total["hidden_bytes"]["expected"],
        "cost_usd": 0.0,
        "seconds": secs,
        "options": options,
    }


def hidden_tp(h: dict, plan: dict) -> int | None:
    """The hidden-states engine's GPUs on this node: 1 in-process, the node for a loopback
    server or one eaglet starts, None for a server elsewhere."""
    if h["backend"] == "transformers":
        return 1
    if h.get("url"):
        return plan.get("gpus") if _local(h["url"]) else None
    return plan.get("gpus") or 1


def train_memory_cells(training: list[dict]) -> tuple[str, str]:
    """(GPU memory, fits) of a drafter's training from its per-dataset peaks (eaglet.reports.plan's
    training_memory): the largest peak, and the datasets whose longest sample does not fit."""
    worst = max(training, key=lambda r: r["peak_bytes"])
    memory = (
        f"{worst['peak_bytes'] / 2**30:.1f} GiB at {worst['tokens']:,} tokens ({worst['dataset']})"
    )
    over = [f"{r['dataset']} at {r['tokens']:,}" for r in training if not r["fits"]]
    return memory, ("DOES NOT FIT: " + ", ".join(over)) if over else "fits"


def drafter_rows(
    keys: Keys, name: str, rows: list[dict], text: dict, where: str, training: list[dict]
) -> list[dict]:
    """vocab, training, evaluation and export of one drafter."""
    p = keys.params
    d, plan = p.drafter(name), p.data["plan"]
    trained, embed = drafter_parameters(
        text, arch.resolve(text, d["arch"], where), d["draft_vocab_size"]
    )
    per_ds = {r["dataset"]: r["hidden_tokens"]["expected"] for r in rows}
    tokens = [per_ds[ds] for ds in d["datasets"]]
    tr = d["train"]
    train_tokens = None if None in tokens else sum(tokens) * (1 - d["heldout_fraction"])
    train_secs = None
    if train_tokens is not None:
        train_secs = tr["epochs"] * train_tokens / plan["train_tokens_per_s"]
    procs = tr["processes"]
    train_gpu, train_fits = train_memory_cells([r for r in training if r["drafter"] == name])
    row = {"node": True, "cost_usd": 0.0, "gpu_gb": None, "fits": "-", "disk_bytes": None}
    row["options"] = []
    out = [
        dict(row, stage=f"vocab {name}", runs_on="this CPU (token counts)", seconds=0.0),
        dict(
            row,
            stage=f"train {name}",
            runs_on=f"torchrun x {procs}" if procs > 1 else f"1 process ({tr['device']})",
            gpu_gb=train_gpu,
            fits=train_fits,
            options=training_options([r for r in training if r["drafter"] == name]),
            disk_bytes=trained * 16 + embed * 4,  # fp32 weights + AdamW state; embeddings fp32
            seconds=train_secs,
        ),
        evaluate_row(keys, name, text, 2 * (trained + embed)),
        dict(
            row,
            stage=f"export {name}",
            runs_on="this CPU",
            disk_bytes=2 * (2 * trained + embed),  # bf16: SGLang's without, vLLM's with embeddings
            seconds=0.0,
        ),
    ]
    return out


def evaluate_row(keys: Keys, name: str, text: dict, drafter_bytes: float) -> dict:
    """Evaluation: on the serving engine (eaglet's, TP N, or an operator's), or in-process."""
    p = keys.params
    d, plan = p.drafter(name), p.data["plan"]
    ev = d["evaluate"]
    own = footprint.in_process(ev, text)
    seq = max(map(p.max_length, d["datasets"])) + ev["max_new_tokens"]
    conc, steps, temps = ev["engine_concurrency"], ev["num_steps"], ev["temperatures"]
    suites = ev.get("suites") or {"heldout": {}}
    modes = ev.get("modes") or [None]
    prompts = len(modes) * sum(s.get("prompts", ev["prompts"]) for s in suites.values())
    decode = prompts * ev["max_new_tokens"] / (plan["decode_tokens_per_s"] * conc)  # one pass
    # the target alone once (greedy: the reference), then each step count at each temperature
    runs = f"{len(suites)} suites x {len(modes)} modes x {len(temps)} temperatures"
    runs += f" x {len(steps)} step counts, {prompts} prompts a pass"
    passes = 1 + len(steps) * len(temps)
    mem, fits, options = None, "-", []
    if ev["engine"] == "none":
        where = "in-process (transformers)" if own else "nowhere: DOES NOT FIT in-process"
        fits = "fits this machine" if own else "DOES NOT FIT"
        secs = passes * decode
    elif "engine_url" in ev:
        where = f"vLLM at {ev['engine_url']} (operator's, with the drafter)"
        secs = passes * decode
    else:
        tp = ev["engine_tensor_parallel_size"]
        where = f"vLLM TP {tp} (eaglet starts, {1 + len(steps)} engines)"
        mem, fits = engine_row(text, plan, tp, conc, seq, drafter_bytes)
        options = engine_options(text, plan, fits, tp, conc, seq, drafter_bytes)
        secs = (1 + len(steps)) * plan["engine_startup_s"] + passes * decode
    if ev["engine"] != "none" and own:
        where += " + in-process"
        secs += len(steps) * len(temps) * decode  # eaglet's own decoder, beside the engine
    where += f"; {runs}"
    return {
        "stage": f"evaluate {name}",
        "runs_on": where,
        "node": True,
        "gpu_gb": mem,
        "fits": fits,
        "disk_bytes": None,
        "cost_usd": 0.0,
        "seconds": secs,
        "options": options,
    }


def stages(
    keys: Keys,
    text: dict,
    where: str,
    rows: list[dict],
    total: dict,
    fits: dict,
    training: list[dict],
) -> dict:
    """Every stage's row and the total wall clock (API generation beside the node's);
    `training`: the per-dataset training peaks of eaglet.reports.plan.training_memory."""
    out = generation_rows(keys, rows, text)
    gen_api = _sum(r["seconds"] for r in out if not r["node"])
    gen_node = _sum(r["seconds"] for r in out if r["node"])
    out.append(hidden_row(keys, total, text, fits))
    for name in keys.params.drafters:
        out += drafter_rows(keys, name, rows, text, where, training)
    shared = colocation(keys, text, training) if training else None
    if shared and shared["engine_gib"] and keys.params.data["hidden"]["mode"] != "offline":
        for r in out:  # the configured mode shares the GPUs: the train rows say so
            if r["stage"].startswith("train "):
                r["fits"] += f"; {shared_cell(shared)}"
    rest = _sum(r["seconds"] for r in out[len(rows) :])
    wall = None
    if None not in (gen_api, gen_node, rest):
        wall = max(gen_api, gen_node) + rest
    return {
        "rows": out,
        "wall_s": wall,
        "generation_api_s": gen_api,
        "generation_node_s": gen_node,
        "rates": rates(keys.params.data["plan"]),
        "colocation": shared,
    }


RATES = {  # plan: rate -> what it times
    "prefill_tokens_per_s": "hidden states",
    "train_tokens_per_s": "training",
    "decode_tokens_per_s": "evaluation, per request",
    "engine_startup_s": "each engine start",
}


def rates(plan: dict) -> list[dict]:
    """Each rate the times rest on and where it comes from: set in params (`plan:`), or the
    schema's default, an assumption until measured on the node."""
    from eaglet.params import schema

    defaults = schema()["properties"]["plan"]["properties"]
    out = [
        {
            "rate": name,
            "value": plan[name],
            "times": what,
            "source": "assumed (default)"
            if plan[name] == defaults[name].get("default")
            else "params",
        }
        for name, what in RATES.items()
    ]
    for backend, given in sorted(plan.get("rates", {}).items()):
        for name, value in given.items():
            out.append({"rate": f"rates.{backend}.{name}", "value": value, "times": backend})
            out[-1]["source"] = "params"
    return out


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


# ------------------------------------------------------- what fits where it does not, re-priced


def _fits(verdict: str) -> bool:
    return verdict.startswith("fits")


def engine_options(
    text: dict, plan: dict, verdict: str, tp: int, seqs: int, seq_len: int, extra: float = 0
) -> list[dict]:
    """Where an engine does not fit (not one sequence beside its weights): FP8 weights (1 byte a
    parameter, where that is less than the weights as served), a second node (TP over twice the
    GPUs), or the longest sequence that fits beside the weights. Fewer in flight cannot help:
    the engine already queues what does not fit."""
    if _fits(verdict) or plan.get("gpu_memory_gb") is None or plan.get("gpus") is None:
        return []
    out = []
    fp8 = footprint.parameters(text)
    if fp8 < weights_bytes(text, plan):
        fp8_plan = plan | {"target_weights_gb": fp8 / GB}
        need, v = engine_row(text, fp8_plan, min(tp, plan["gpus"]), seqs, seq_len, extra)
        out.append(_engine_option("fp8_weights", "FP8 weights", need, v))
    two = 2 * plan["gpus"]
    need, v = engine_row(text, plan | {"gpus": two}, two, seqs, seq_len, extra)
    out.append(_engine_option("another_node", f"a second node: TP {two}", need, v))
    weights = (weights_bytes(text, plan) + extra) / min(tp, plan["gpus"])
    room = ENGINE_FRACTION * plan["gpu_memory_gb"] * GIB - weights
    per_token = footprint.kv_bytes_per_token(text, min(tp, plan["gpus"]))
    if room >= per_token:
        longest = int(room // per_token)
        out.append({"option": "engine_max_length", "change": "max_length", "tokens": longest})
        out[-1]["fits"] = True
    return out


def _engine_option(kind: str, change: str, need: dict, verdict: str) -> dict:
    return {"option": kind, "change": change, **need, "verdict": verdict, "fits": _fits(verdict)}


def training_options(training: list[dict]) -> list[dict]:
    """Where a drafter's longest sample does not fit a GPU: train.max_length at the longest that
    fits (samples cut there), batch 1 if larger, or a GPU with the largest peak. More DDP
    processes do not help: each holds the whole drafter and its optimizer state."""
    over = [r for r in training if not r["fits"]]
    if not over:
        return []
    worst = max(over, key=lambda r: r["peak_bytes"])
    longest = worst["longest_that_fits"]
    out = [
        {
            "option": "train_max_length",
            "change": "train.max_length",
            "tokens": longest,
            "cut": [r["dataset"] for r in over],
            "fits": longest >= 1,
        }
    ]
    if worst["batch_size"] > 1:
        one = sum(worst["fixed_bytes"].values()) + worst["per_token_bytes"] * worst["tokens"]
        out.append(
            {
                "option": "batch_size",
                "change": "train.batch_size: 1",
                "peak_gib": one / GIB,
                "fits": one <= worst["gpu_bytes"],
            }
        )
    gpu = {"option": "bigger_gpu", "change": "a GPU of", "peak_gib": worst["peak_bytes"] / GIB}
    return [*out, gpu | {"fits": True}]


def colocation(keys: Keys, text: dict, training: list[dict]) -> dict:
    """Each GPU in online and hybrid modes, where the trainer asks the hidden-states engine for
    states while it trains: the engine's weights / TP + the KV of one sequence of the longest
    max_length, and the largest training peak, against the trainer's GPU (`--gpu-memory`).
    engine_gib None: the engine is on another node."""
    p = keys.params
    h, plan = p.data["hidden"], p.data["plan"]
    gpu = training[0]["gpu_bytes"]
    worst = max(training, key=lambda r: r["peak_bytes"])
    out = {"gpu_gib": gpu / GIB, "trainer_gib": worst["peak_bytes"] / GIB}
    out |= {"trainer_fits": all(r["fits"] for r in training), "tp": hidden_tp(h, plan)}
    if out["tp"] is None:
        return out | {
            "engine_gib": None,
            "sum_gib": out["trainer_gib"],
            "fits": out["trainer_fits"],
        }
    tp, longest = out["tp"], max(map(p.max_length, p.datasets))
    weights = weights_bytes(text, plan) / tp
    kv = footprint.kv_bytes_per_token(text, tp)
    engine = weights + kv * longest
    # the longest sample (same length for both) with which engine and trainer fit together
    fixed = max(sum(r["fixed_bytes"].values()) for r in training)
    per = max(r["per_token_bytes"] * r["batch_size"] for r in training)
    both = max(0, int((gpu - weights - fixed) // (kv + per)))
    return out | {
        "weights_gib": weights / GIB,
        "kv_gib_per_seq": kv * longest / GIB,
        "tokens": longest,
        "engine_gib": engine / GIB,
        "sum_gib": (engine + worst["peak_bytes"]) / GIB,
        "fits": engine + worst["peak_bytes"] <= gpu,
        "longest_both_fit": both,
    }


def shared_cell(c: dict, shares: bool = True, verdict: bool = True) -> str:
    """One GPU while training, from `colocation`: engine + trainer where they share it (the
    engine on another node: the trainer alone), else the trainer with the engine before it."""
    if not shares or c["engine_gib"] is None:
        fits = c["trainer_fits"]
        where = "the engine before it" if not shares else "the engine on another node"
        text = f"trainer {c['trainer_gib']:.1f} GiB of {c['gpu_gib']:.0f} ({where})"
    else:
        fits = c["fits"]
        text = (
            f"engine {c['engine_gib']:.1f} + trainer {c['trainer_gib']:.1f} = "
            f"{c['sum_gib']:.1f} GiB of {c['gpu_gib']:.0f}"
        )
    return text + (f": {'fits' if fits else 'DOES NOT FIT'}" if verdict else "")


def colocation_options(c: dict, offline_disk: dict) -> list[dict]:
    """Where engine and trainer do not fit one GPU together: offline (in sequence: the trainer
    alone, and offline's node disk `offline_disk` {total, fits}), the engine on another node
    (hidden.url, a spool both nodes mount), or every max_length at the longest that fits both."""
    if c["fits"]:
        return []
    out = [
        {
            "option": "offline",
            "change": "hidden.mode: offline",
            "trainer_gib": c["trainer_gib"],
            "disk_bytes": offline_disk["total"],
            "disk_fits": offline_disk["fits"],
            "fits": c["trainer_fits"] and bool(offline_disk["fits"]),
        },
        {
            "option": "engine_elsewhere",
            "change": "hidden.url on another node",
            "trainer_gib": c["trainer_gib"],
            "fits": c["trainer_fits"],
        },
    ]
    if c["engine_gib"] is not None:
        tokens = c["longest_both_fit"]
        out.append({"option": "shared_max_length", "change": "max_length", "tokens": tokens})
        out[-1]["fits"] = tokens >= 1
    return out
