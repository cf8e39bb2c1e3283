"""`eaglet plan`: what a params file will cost before anything runs (reporting only).

Per dataset and in total: prompts, completion tokens (expected and maximal), dollars, and the
hidden states' tokens and bytes on disk in the configured storage, with a free-disk check
where they will be written. Nothing is sent, loaded or built; only config.json of the target
is read (or `--target-config`).

- prompts: the built prompts artifact's count if there is one, else `max_samples`.
- turns (requests a conversation): counted in the built prompts under the dataset's `turns`
  (eaglet.stages.responses.turns), else `expect.turns` (default 1).
- completion tokens: expected = prompts x turns x `expect.completion_tokens` (a turn's answer),
  max = prompts x turns x `max_new_tokens`; both capped by `token_budget` (the stage keeps the
  longest prefix of conversations that fits).
- dollars (API backends with `price_per_mtok`): completion tokens x its completion price, plus
  prompts x `expect.prompt_tokens` x its prompt price when that is given; capped by
  `max_cost_usd`. Engines on your own GPUs show 0 (their cost is GPU time, not tokens).
- hidden tokens: a sample per turn, prompt (`expect.prompt_tokens`: a request's) + answer, at
  most the dataset's `max_length`: exact where each turn is a sample of its own (a template that
  rewrites the history, a trajectory regenerated from its recorded history), an upper bound
  where turns share a sample (eaglet.stages.hidden.kernel.sequences).
- bytes per token: (K + 1) states x H x 2 (bf16) x the storage's measured ratio
  (STORAGE_RATIO; bf16 planes for fp32 x 2).
- per hidden.mode (`mode_rows`): disk for hidden states and the engine's prefill tokens.
  offline: the shards, one prefill; online: the token ids alone (5 B/token), a prefill every
  epoch of every drafter (tokens x epochs); hybrid: the shards (as a cache), one prefill.
- training memory per GPU, per drafter and dataset (eaglet.model.train_memory): the peak of one
  micro-batch of the dataset's longest sample, against `--gpu-memory`, and the longest sample
  that fits.
- the node's disk at once (`disk_model`, eaglet.graph.footprint.node_disk): the target's
  weights, the hidden states, DVC's cache copy, the spool (up to: requests in flight x the longest
  max_length x the layers kept x H x the compute dtype's bytes: what the engine writes before
  eaglet compresses it; x training processes online and hybrid, each asks for its own),
  training's folders and the exports, against the free disk; where it does not fit, the
  options that change one thing each (footprint.disk_options).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eaglet.device import resolve_dtype
from eaglet.errors import EagletError
from eaglet.formats.io import read_json, read_jsonl
from eaglet.graph import footprint
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model import arch, train_memory
from eaglet.model.target import need, read_config, spec_of, text_config
from eaglet.params import Params
from eaglet.reports import placement
from eaglet.stages.hidden.spec import sglang_layer_ids
from eaglet.stages.responses.turns import cuts

# bytes on disk / (K+1)·H·2 as measured by benchmarks/hidden_states.py on SmolLM2 (README):
# bf16 1.001, bf16+zstd 0.730, fp8 0.505 (1 byte a value + a float32 scale per token and
# layer), fp8+zstd 0.434
STORAGE_RATIO = {
    ("bfloat16", False, "none"): 1.001,
    ("bfloat16", False, "zstd"): 0.730,
    ("fp8", True, "none"): 0.505,
    ("fp8", True, "zstd"): 0.434,
}


def bytes_per_token(hidden: dict, n_aux: int, width: int) -> float:
    """Expected bytes on disk per token of the hidden-states stage's storage."""
    fp8 = hidden["fp8"]
    dtype = "fp8" if fp8 else "bfloat16"
    ratio = STORAGE_RATIO[(dtype, fp8, hidden["compress"])]
    if not fp8 and hidden["dtype"] == "float32":
        ratio *= 2
    return (n_aux + 1) * width * 2 * ratio


def target_text(params: Params, config: Path | None = None) -> tuple[dict, str, str]:
    """(text config, where, field prefix) of the target's language model, from config.json."""
    if config is not None:
        try:
            raw, where = read_json(config), str(config)
        except (OSError, ValueError) as e:
            raise EagletError(f"{config}: unreadable: {e}") from None
    else:
        try:
            raw, where = read_config(spec_of(params))
        except EagletError:
            raise
        except Exception as e:  # a hub target offline: nothing to read config.json from
            raise EagletError(
                f"target {params.target['model']}: config.json not readable here ({e}); "
                "give it with --target-config"
            ) from None
    text, prefix = text_config(raw)
    for field in ("hidden_size", "num_hidden_layers"):
        need(text, field, where, prefix)
    return text, where, prefix


def training_memory(
    params: Params, text: dict, where: str, prefix: str, gpu_bytes: float
) -> list[dict]:
    """Per drafter and dataset: the estimated training peak per GPU (eaglet.model.train_memory, on
    cuda) of one micro-batch of the dataset's longest sample, against `gpu_bytes`."""
    rows = []
    for name in params.drafters:
        d = params.drafter(name)
        t = d["train"]
        shape = train_memory.Shape.of(
            arch.resolve(text, d["arch"], where, prefix),
            need(text, "hidden_size", where, prefix),
            need(text, "vocab_size", where, prefix),
            d["draft_vocab_size"],
            t["ttt_length"],
        )
        dtype = resolve_dtype(t["dtype"], "cuda")
        cap = t.get("max_length") or max(map(params.max_length, d["datasets"]))
        longest = train_memory.longest(shape, gpu_bytes, dtype) // t["batch_size"]
        for ds in d["datasets"]:
            length = min(params.max_length(ds), cap)
            est = train_memory.estimate(shape, t["batch_size"] * length, dtype)
            rows.append(
                {
                    "drafter": name,
                    "dataset": ds,
                    "tokens": length,
                    "batch_size": t["batch_size"],
                    "dtype": dtype,
                    "peak_bytes": est["peak"],
                    "fixed_bytes": est["fixed_items"],
                    "per_token_bytes": est["per_token"],
                    "gpu_bytes": gpu_bytes,
                    "fits": est["peak"] <= gpu_bytes,
                    "longest_that_fits": longest,
                }
            )
    return rows


def render_training(rows: list[dict]) -> list[str]:
    """One line per drafter and dataset: peak per GPU at its longest sample, and the verdict."""
    gib = train_memory.GIB
    return [
        f"train {r['drafter']} on {r['dataset']}: {r['tokens']:,} tokens x batch "
        f"{r['batch_size']} ({r['dtype']}): {r['peak_bytes'] / gib:.1f} GiB per GPU of "
        f"{r['gpu_bytes'] / gib:.0f} GiB: {'fits' if r['fits'] else 'DOES NOT FIT'} (longest "
        f"sample that fits: {r['longest_that_fits']:,} tokens)"
        for r in rows
    ]


def _prompts(keys: Keys, ds: str) -> tuple[int | None, float, str]:
    """(prompt count, mean turns regenerated a prompt, where they come from)."""
    d = keys.params.dataset(ds)
    turns = keys.params.generation(ds)["turns"]
    try:
        path = keys.path("prompts", ds)
        if sidecar_of(path).exists():
            n = t = 0
            for p in read_jsonl(path):
                n, t = n + 1, t + len(cuts(p["messages"], turns))
            return n, t / n if n else 1.0, "built"
    except EagletError:  # the raw file is not there yet: its key cannot be computed
        pass
    return d.get("max_samples"), float(d.get("expect", {}).get("turns", 1)), "max_samples"


def dataset_plan(keys: Keys, ds: str, token_bytes: float) -> dict:
    """The numbers of one dataset (None where the params do not say)."""
    p = keys.params
    d, gen = p.dataset(ds), p.generation(ds)
    backend = p.backend(gen["backend"])
    n, turns, source = _prompts(keys, ds)
    expect = d.get("expect", {})
    max_len = p.max_length(ds)
    prompt_cap = d.get("max_prompt_tokens", p.data["prompts"].get("max_prompt_tokens"))

    def capped(x: float | None, cap: float | None) -> float | None:
        return None if x is None else (x if cap is None else min(x, cap))

    mean_p = expect.get("prompt_tokens")
    # a conversation's answers (every turn), as measured or guessed
    mean_c = expect["completion_tokens"] * turns if "completion_tokens" in expect else None
    budget = d.get("token_budget")
    # conversations answered: all prompts, or as many as the token budget lets through
    n_exp = capped(n, budget / mean_c if budget and mean_c else None) if mean_c else None
    tok = {
        "expected": n_exp * mean_c if n_exp is not None else None,
        "max": capped(round(n * turns) * gen["max_new_tokens"] if n else None, budget),
    }
    price = backend.get("price_per_mtok") if backend["kind"] == "openai" else None
    cost: dict = {"expected": None, "max": None}
    if backend["kind"] != "openai":
        cost = {"expected": 0.0, "max": 0.0}
    elif price:
        for k, answered in (("expected", n_exp), ("max", n)):
            if tok[k] is not None:
                prompt_tokens = answered * turns * mean_p if answered and mean_p else 0
                usd = tok[k] * price.get("completion", 0) + prompt_tokens * price.get("prompt", 0)
                cost[k] = capped(usd / 1e6, d.get("max_cost_usd"))
    per_sample_max = min(max_len, (prompt_cap or max_len) + gen["max_new_tokens"])
    per_turn = expect.get("completion_tokens")
    hidden_tokens = {
        "expected": n_exp * turns * min(max_len, mean_p + per_turn) if n_exp and mean_p else None,
        "max": round(n * turns) * per_sample_max if n else None,
    }
    if tok["max"] is not None and hidden_tokens["max"] is not None and prompt_cap:
        hidden_tokens["max"] = min(hidden_tokens["max"], tok["max"] + round(n * turns) * prompt_cap)
    return {
        "dataset": ds,
        "backend": gen["backend"],
        "prompts": n,
        "turns": round(turns, 3),
        "requests": {
            "expected": n_exp * turns if n_exp is not None else None,
            "max": round(n * turns) if n else None,
        },
        "answered": n_exp,
        "prompts_from": source,
        "max_length": max_len,
        "completion_tokens": tok,
        "cost_usd": cost,
        "hidden_tokens": hidden_tokens,
        "hidden_bytes": {
            k: v * token_bytes if v is not None else None for k, v in hidden_tokens.items()
        },
    }


def plan(
    params: Params,
    target_config: Path | None = None,
    gpu_memory: float = 96 * 2**30,
    free_disk: float | None = None,
) -> dict:
    """The whole plan: per dataset, totals, the disk checks, training memory per GPU and what
    to change where something does not fit. `free_disk` (bytes): the node's, else measured
    where data/hidden will be written."""
    keys = Keys(params)
    text, where, prefix = target_text(params, target_config)
    width, layers = (need(text, f, where, prefix) for f in ("hidden_size", "num_hidden_layers"))
    h = params.data["hidden"]
    n_aux = len(sglang_layer_ids(h) or ()) or 3  # SGLang's default: 3 layers
    token_bytes = bytes_per_token(h, n_aux, width)
    rows = [dataset_plan(keys, ds, token_bytes) for ds in params.datasets]
    total: dict = {"dataset": "total", "backend": "", "prompts": _sum(r["prompts"] for r in rows)}
    for field in ("completion_tokens", "cost_usd", "hidden_tokens", "hidden_bytes"):
        total[field] = {k: _sum(r[field][k] for r in rows) for k in ("expected", "max")}
    cap = params.data["budget"].get("max_cost_usd")
    if cap is not None:
        total["cost_usd"] = {
            k: v if v is None else min(v, cap) for k, v in total["cost_usd"].items()
        }
    out = params.root / "data" / "hidden"
    probe = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(probe).free if free_disk is None else free_disk
    fits = {k: None if v is None else v <= free for k, v in total["hidden_bytes"].items()}
    shown = os.path.relpath(probe) if probe.is_relative_to(Path.cwd()) else str(probe)
    shown = shown if free_disk is None else "the node (given)"
    training = training_memory(params, text, where, prefix, gpu_memory)
    stages = placement.stages(keys, text, where, rows, total, fits, training)
    model = disk_model(params, text, total, stages["rows"], token_bytes, n_aux, free)
    node = footprint.node_disk(model, h["mode"])
    options = disk_options(params, rows, model, node, n_aux, width, stages["colocation"])
    return {
        "target": {"config": where, "hidden_size": width, "num_hidden_layers": layers},
        "stages": stages,
        "node_disk": node
        | {"dvc": model["dvc"], "spool": model["spool_shape"]}
        | {"drafters": params.drafters, "options": options},
        "storage": {
            "dtype": h["dtype"],
            "fp8": h["fp8"],
            "compress": h["compress"],
            "bytes_per_token": round(token_bytes),
        },
        "datasets": rows,
        "total": total,
        "disk": {"path": shown, "free_bytes": free, "fits": fits},
        "hidden_modes": mode_rows(params, rows, free, model, stages["colocation"]),
        "training": training,
    }


def disk_model(
    params: Params,
    text: dict,
    total: dict,
    stage_rows: list[dict],
    token_bytes: float,
    n_aux: int,
    free: float,
) -> dict:
    """The inputs of eaglet.graph.footprint.node_disk from the plan's own numbers."""
    h, plan = params.data["hidden"], params.data["plan"]
    width = text["hidden_size"]
    longest = max(map(params.max_length, params.datasets))
    dtype = resolve_dtype(h["compute_dtype"], "cuda")
    shape = {
        "in_flight": h["concurrency"],
        "tokens": longest,
        "layers": n_aux + 1,  # the aux layers and the last
        "width": width,
        "dtype": dtype,
        "dtype_bytes": footprint.DTYPE_BYTES[dtype],
        "processes": max(
            (params.drafter(d)["train"]["processes"] for d in params.drafters), default=1
        ),
        "path": h.get("spool") or "a temporary directory",
        "backend": h["backend"],
    }
    one = shape["in_flight"] * longest * shape["layers"] * width * shape["dtype_bytes"]
    offline = one if h["backend"] == "vllm" else 0  # the others return the states, no spool
    online = one * shape["processes"]  # online and hybrid: vLLM, each process asks on its own
    dvc = footprint.dvc_cache(params.root)

    def disk(kind: str) -> float:
        return sum(r["disk_bytes"] or 0 for r in stage_rows if r["stage"].startswith(kind))

    return {
        "tokens": total["hidden_tokens"],
        "token_bytes": token_bytes,
        "id_bytes": TOKEN_ID_BYTES,
        "weights": placement.weights_bytes(text, plan),
        "spool": {"offline": offline, "online": online, "hybrid": online},
        "spool_shape": shape,
        "train": disk("train "),
        "exports": disk("export "),
        "copies": dvc["copies"],
        "dvc": dvc,
        "free": free,
    }


def disk_options(
    params: Params,
    rows: list[dict],
    model: dict,
    node: dict,
    n_aux: int,
    width: int,
    shared: dict | None,
) -> list[dict]:
    """Where the node's disk does not fit: footprint.disk_options with the dataset of the most
    hidden-state bytes and the storages with FP8 or zstd turned on; online's option also with
    its GPUs (placement.colocation), as it trains beside the engine."""
    if node["fits"]["expected"] is not False:
        return []
    h = params.data["hidden"]
    storages = {
        "hidden.fp8: true": bytes_per_token(h | {"fp8": True}, n_aux, width),
        "hidden.compress: zstd": bytes_per_token(h | {"compress": "zstd"}, n_aux, width),
    }
    big = max(rows, key=lambda r: r["hidden_bytes"]["expected"] or 0)
    largest = {"dataset": big["dataset"], "answered": big["answered"]}
    largest["tokens"] = big["hidden_tokens"]["expected"]
    out = footprint.disk_options(model, h["mode"], largest, storages)
    for o in out:
        if o["option"] == "online" and shared is not None:
            o |= {"gpu": shared, "disk_fits": o["fits"]}
            o["fits"] = bool(o["fits"]) and shared["fits"]
    return out


TOKEN_ID_BYTES = 5  # int32 id + bool mask: what an online manifest keeps per token


def mode_rows(
    params: Params, rows: list[dict], free: int, model: dict, shared: dict | None
) -> list[dict]:
    """Per hidden.mode: expected disk for hidden states, the node's disk in that mode, engine
    prefill tokens (one epoch and all training), and online and hybrid's GPUs shared by the
    engine and the trainer (placement.colocation); `fits`: disk and GPUs."""
    tokens = {r["dataset"]: r["hidden_tokens"]["expected"] for r in rows}
    size = {r["dataset"]: r["hidden_bytes"]["expected"] for r in rows}
    once = _sum(tokens.values())
    epochs_x = _sum(  # every drafter re-reads its datasets each epoch
        _sum(tokens[ds] for ds in d["datasets"]) * d["train"]["epochs"]
        if _sum(tokens[ds] for ds in d["datasets"]) is not None
        else None
        for d in (params.drafter(n) for n in params.data["drafters"])
    )
    ids = None if once is None else once * TOKEN_ID_BYTES
    shards = _sum(size.values())
    offline = footprint.node_disk(model, "offline")
    offline = {"total": offline["total"]["expected"], "fits": offline["fits"]["expected"]}
    colocated_options = placement.colocation_options(shared, offline) if shared else []
    out = []
    for mode, disk, prefill in (
        ("offline", None if shards is None else shards + ids, once),
        ("online", ids, epochs_x),
        ("hybrid", None if shards is None else shards + ids, once),
    ):
        node = footprint.node_disk(model, mode)
        shares = mode != "offline"  # online and hybrid train beside the engine
        gpu_fits = True if shared is None else shared["fits" if shares else "trainer_fits"]
        node_fits = node["fits"]["expected"]
        out.append(
            {
                "mode": mode,
                "disk_bytes": disk,
                "disk_fits": None if disk is None else disk <= free,
                "node_disk_bytes": node["total"]["expected"],
                "node_disk_fits": node_fits,
                "gpu": shared,
                "shares_gpus": shares,
                "gpu_fits": gpu_fits,
                "fits": None if node_fits is None else node_fits and gpu_fits,
                "options": colocated_options if shares else [],
                "prefill_tokens_per_epoch": once,
                "prefill_tokens_total": prefill,
                "repeats_each_epoch": mode == "online",
            }
        )
    return out


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def _usd(x: float | None) -> str:
    return "?" if x is None else f"${x:,.0f}"


def _prompts_cell(r: dict) -> str:
    """The prompt count, and the turns each asks where that is not one."""
    if r["prompts"] is None:
        return "?"
    turns = r.get("turns", 1)
    return f"{r['prompts']:,}" + (f" x {turns:.2f} turns" if turns != 1 else "")


def render(report: dict) -> str:
    """The plan as a Markdown table and two lines of context."""
    t, s = report["target"], report["storage"]
    head = (
        f"target: hidden {t['hidden_size']}, {t['num_hidden_layers']} layers ({t['config']}); "
        f"hidden states: {'fp8' if s['fp8'] else s['dtype']}"
        f"{' + zstd' if s['compress'] == 'zstd' else ''}, {s['bytes_per_token']:,} B/token"
    )
    cols = ["dataset", "backend", "prompts", "max_length", "completion tok (exp / max)"]
    cols += ["cost (exp / max)", "hidden tok (exp / max)", "hidden disk (exp / max)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in [*report["datasets"], report["total"]]:
        ct, cost, ht, hb = (
            r["completion_tokens"],
            r["cost_usd"],
            r["hidden_tokens"],
            r["hidden_bytes"],
        )
        cells = [
            r["dataset"],
            r["backend"],
            _prompts_cell(r),
            f"{r['max_length']:,}" if "max_length" in r else "",
            f"{_num(ct['expected'])} / {_num(ct['max'])}",
            f"{_usd(cost['expected'])} / {_usd(cost['max'])}",
            f"{_num(ht['expected'])} / {_num(ht['max'])}",
            f"{_num(hb['expected'], 'B')} / {_num(hb['max'], 'B')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    d = report["disk"]
    verdict = {True: "fits", False: "DOES NOT FIT", None: "unknown"}
    disk = f"free disk at {d['path']}: {_num(d['free_bytes'], 'B')}; hidden states, " + ", ".join(
        f"{k} {_num(report['total']['hidden_bytes'][k], 'B')}: {verdict[d['fits'][k]]}"
        for k in ("expected", "max")
    )
    return "\n".join(
        [
            head,
            "",
            *lines,
            "",
            disk,
            "",
            *render_stages(report["stages"]),
            "",
            *render_node_disk(report["node_disk"]),
            "",
            *render_modes(report),
            "",
            *render_training(report["training"]),
        ]
    )


VERDICT = {True: "fits", False: "DOES NOT FIT", None: "unknown"}
PARTS = {
    "target_weights": "target weights",
    "hidden_states": "hidden states",
    "dvc_cache_copy": "DVC cache copy",
    "hidden_spool": "hidden spool, up to",
    "training_folders": "training folders",
    "exports": "exports",
}


def render_node_disk(n: dict) -> list[str]:
    """What the node's disk holds at once, part by part, the total against the free disk, and
    the options where it does not fit."""
    dvc, sp = n["dvc"], n["spool"]
    link = "a second copy" if dvc["copies"] else "linked where .dvc/cache shares data/'s disk"
    cache_dir = f", cache.dir {dvc['dir']}" if dvc["dir"] else ""
    ids = "token ids" if n["mode"] == "online" else "shards + token ids"
    procs = f" x {sp['processes']} processes" if n["mode"] != "offline" else ""
    drafters = ",".join(n["drafters"])
    drafters = f"{{{drafters}}}" if len(n["drafters"]) > 1 else drafters
    where = {
        "target_weights": "the shared HF cache (plan.target_weights_gb, else parameters x 2 B)",
        "hidden_states": f"data/hidden ({n['mode']}: {ids})",
        "dvc_cache_copy": f"make store, cache.type {dvc['type']} ({dvc['from']}{cache_dir}): "
        + link,
        "hidden_spool": f"{sp['path']}: {sp['in_flight']} in flight{procs} x "
        f"{sp['tokens']:,} tokens x {sp['layers']} layers x {sp['width']:,} x "
        f"{sp['dtype_bytes']} B ({sp['dtype']})"
        if n["parts"]["hidden_spool"]["expected"]
        else f"none: hidden.backend {sp['backend']} returns the states",
        "training_folders": f"models/{drafters}/train",
        "exports": f"models/{drafters}/sglang, vllm",
    }
    lines = ["| node disk, at once | expected | max | where |", "|---|---|---|---|"]
    for part, v in n["parts"].items():
        cells = [PARTS[part], _num(v["expected"], "B"), _num(v["max"], "B"), where[part]]
        lines.append("| " + " | ".join(cells) + " |")
    t, f = n["total"], n["fits"]
    verdict = f"{VERDICT[f['expected']]} (expected), {VERDICT[f['max']]} (max)"
    free = f"of {_num(n['free_bytes'], 'B')} free: {verdict}"
    lines.append(f"| total | {_num(t['expected'], 'B')} | {_num(t['max'], 'B')} | {free} |")
    if n["options"]:
        lines += ["", "node disk options (each alone, expected):"]
        lines += [_option(o) for o in n["options"]]
    return lines


def _option(o: dict) -> str:
    """One option as a line: the change, its numbers, the verdict."""
    kind, change = o["option"], o["change"]
    total = _num(o.get("total_bytes"), "B")
    saves = f"total {total} (saves {_num(o.get('saves_bytes'), 'B')})"
    if kind == "fewer_samples" and o["fits"]:
        text = f"{change}: {o['max_samples']:,} (now {o['now']:,} answered): total {total}"
    elif kind == "fewer_samples":
        rest = _num(o["rest_bytes"], "B")
        text = f"fewer {o['dataset']} samples: none is enough (the rest alone is {rest})"
    elif kind in ("storage", "dvc_link"):
        text = f"{change}{' reflink,hardlink,copy' if kind == 'dvc_link' else ''}: {saves}"
    elif kind == "second_disk":
        text = f"{change} ({_num(o['needs_bytes'], 'B')} there): this disk keeps {total}"
    elif kind == "online":
        text = f"{change}: online: {saves}, disk {VERDICT[o.get('disk_fits', o['fits'])]}"
        text += f"; GPUs: {placement.shared_cell(o['gpu'], verdict=False)}" if "gpu" in o else ""
    elif kind in ("fp8_weights", "another_node"):
        kv = f"{o['kv_gib_per_seq']:.2f} GiB KV x {o['seqs']}"
        return f"- {change}: {o['weights_gib']:.1f} GiB weights + {kv}: {o['verdict']}"
    elif kind == "engine_max_length":
        text = f"max_length {o['tokens']:,} at most (one sequence beside the weights)"
    elif kind == "train_max_length":
        text = f"{change}: {o['tokens']:,} (cuts {', '.join(o['cut'])})"
    elif kind == "batch_size":
        text = f"{change}: peak {o['peak_gib']:.1f} GiB"
    elif kind == "bigger_gpu":
        text = f"{change} {o['peak_gib']:.1f} GiB or more"
    elif kind == "offline":
        disk = f"node disk {_num(o['disk_bytes'], 'B')} ({VERDICT[o['disk_fits']]})"
        text = f"{change} (engine, then trainer): trainer {o['trainer_gib']:.1f} GiB, {disk}"
    elif kind == "engine_elsewhere":
        text = f"{change} (a spool both mount): trainer {o['trainer_gib']:.1f} GiB alone"
    elif o["fits"]:  # shared_max_length
        text = f"every max_length {o['tokens']:,} at most (engine and trainer together)"
    else:
        text = "a shorter max_length: none lets engine and trainer fit together"
    return f"- {text}: {VERDICT[o['fits']]}"


def render_modes(report: dict) -> list[str]:
    """The hidden.mode table: disk, GPUs while training and engine prefill per mode; the
    options under it where a mode's GPUs do not fit."""
    cols = ["hidden.mode", "hidden-state disk (exp)", "node disk (exp)", "GPU while training"]
    cols += ["engine prefill tok / epoch", "prefill tok, all training", "fits"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    options: dict[str, list] = {}  # online and hybrid share one engine beside the trainer
    for r in report["hidden_modes"]:
        total = _num(r["prefill_tokens_total"])
        if r["repeats_each_epoch"]:
            total += " (repeated every epoch: tokens x epochs)"
        disk = f"{_num(r['disk_bytes'], 'B')} ({VERDICT[r['disk_fits']]})"
        node = f"{_num(r['node_disk_bytes'], 'B')} ({VERDICT[r['node_disk_fits']]})"
        gpu = "-" if r["gpu"] is None else placement.shared_cell(r["gpu"], r["shares_gpus"])
        gpu += " (first epoch)" if r["mode"] == "hybrid" and r["gpu"] else ""
        cells = [r["mode"], disk, node, gpu, _num(r["prefill_tokens_per_epoch"]), total]
        lines.append("| " + " | ".join([*cells, VERDICT[r["fits"]]]) + " |")
        if r["options"]:
            options.setdefault("\n".join(map(_option, r["options"])), []).append(r["mode"])
    for text, modes in options.items():
        lines += ["", f"hidden.mode {' and '.join(modes)}: engine and trainer on one GPU; options:"]
        lines += text.splitlines()
    return lines


def _hours(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def render_stages(st: dict) -> list[str]:
    """The run stage by stage, and its total wall clock."""
    cols = ["stage", "runs on", "GPU memory / device", "fits", "disk", "cost", "time (exp)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in st["rows"]:
        mem = r["gpu_gb"]
        if isinstance(mem, dict):
            kv = f"{mem['kv_gib_per_seq']:.2f} GiB KV x {mem['seqs']}"
            mem = f"{mem['weights_gib']:.1f} GiB weights + {kv}"
        mem = "-" if mem is None else mem
        disk = "-" if r["disk_bytes"] is None else _num(r["disk_bytes"], "B")
        cells = [r["stage"], r["runs_on"], mem, r["fits"], disk, _usd(r["cost_usd"])]
        lines.append("| " + " | ".join([*cells, _hours(r["seconds"])]) + " |")
    wall = (
        f"wall clock (expected): {_hours(st['wall_s'])} = max(API generation "
        f"{_hours(st['generation_api_s'])}, generation on the node "
        f"{_hours(st['generation_node_s'])}) + the node's stages in sequence"
    )
    marked = ", ".join(
        f"{r['rate']} {r['value']:,} ({r['times']}; {r['source']})" for r in st.get("rates", [])
    )
    options = []
    for r in st["rows"]:
        if r.get("options"):
            options += ["", f"{r['stage']} options (GPU memory):"]
            options += [_option(o) for o in r["options"]]
    return [*lines, "", wall, f"rates: {marked}" if marked else "", *options]
