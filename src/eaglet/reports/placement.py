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
"""

from __future__ import annotations

from urllib.parse import urlparse

from eaglet.graph import footprint
from eaglet.graph.keys import Keys
from eaglet.model import arch

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
    """(trained parameters, frozen embeddings) of an EAGLE-3 drafter: fc 3H->H, one Llama layer
    on [embedding; hidden] (2H in), its MLP, the draft lm_head; the embeddings are the target's."""
    h = text["hidden_size"]
    q = resolved["num_attention_heads"] * resolved["head_dim"]
    kv = resolved["num_key_value_heads"] * resolved["head_dim"]
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * resolved["intermediate_size"]
    norms = 4 * h  # input, hidden, post-attention, final
    return 3 * h * h + layer + norms + draft_vocab * h, text["vocab_size"] * h


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
        mem, fits = (None, "-")
        if tp:
            seqs = cfg.get("concurrency", 1)
            mem, fits = engine_row(text, plan, tp, seqs, r["max_length"])
        rate = plan["rates"].get(name, {})
        n_exp = r["answered"]
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
    if h["backend"] == "transformers":
        where, tp = f"transformers in-process ({h['device']})", 1
    elif h.get("url"):
        tp = plan.get("gpus") if _local(h["url"]) else None
        where = f"{h['backend']} at {h['url']}" + (f", TP {tp} on this node" if tp else "")
    else:
        tp = plan.get("gpus") or 1
        where = f"vLLM TP {tp} (eaglet starts)"
        secs = secs + plan["engine_startup_s"] if secs is not None else None
    mem, fits = engine_row(text, plan, tp, h["concurrency"], longest) if tp else (None, "-")
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
    }


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
    out = [
        dict(row, stage=f"vocab {name}", runs_on="this CPU (token counts)", seconds=0.0),
        dict(
            row,
            stage=f"train {name}",
            runs_on=f"torchrun x {procs}" if procs > 1 else f"1 process ({tr['device']})",
            gpu_gb=train_gpu,
            fits=train_fits,
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
    mem, fits = None, "-"
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
