"""`eaglet plan`: what a params file will cost before anything runs (reporting only).

Per dataset and in total: prompts, completion tokens (expected and maximal), dollars, and the
hidden states' tokens and bytes on disk in the configured storage, with a free-disk check
where they will be written. Nothing is sent, loaded or built; only config.json of the target
is read (or `--target-config`).

- prompts: the built prompts artifact's count if there is one, else `max_samples`.
- completion tokens: expected = prompts x `expect.completion_tokens`, max = prompts x
  `max_new_tokens`; both capped by `token_budget` (the stage keeps the longest prefix of
  answers that fits).
- dollars (API backends with `price_per_mtok`): completion tokens x its completion price, plus
  prompts x `expect.prompt_tokens` x its prompt price when that is given; capped by
  `max_cost_usd`. Engines on your own GPUs show 0 (their cost is GPU time, not tokens).
- hidden tokens per sample: prompt + answer, at most the dataset's `max_length`.
- bytes per token: (K + 1) states x H x 2 (bf16) x the storage's measured ratio
  (STORAGE_RATIO; bf16 planes for fp32 x 2).
- per hidden.mode (`mode_rows`): disk for hidden states and the engine's prefill tokens.
  offline: the shards, one prefill; online: the token ids alone (5 B/token), a prefill every
  epoch of every drafter (tokens x epochs); hybrid: the shards (as a cache), one prefill.
- training memory per GPU, per drafter and dataset (eaglet.model.train_memory): the peak of one
  micro-batch of the dataset's longest sample, against `--gpu-memory`, and the longest sample
  that fits.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eaglet.device import resolve_dtype
from eaglet.errors import EagletError
from eaglet.formats.io import read_json
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model import arch, train_memory
from eaglet.model.target import need, read_config, spec_of, text_config
from eaglet.params import Params
from eaglet.reports import placement
from eaglet.stages.hidden_spec import sglang_layer_ids

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


def _prompts(keys: Keys, ds: str) -> tuple[int | None, str]:
    """(prompt count, where it comes from)."""
    d = keys.params.dataset(ds)
    try:
        side = sidecar_of(keys.path("prompts", ds))
        if side.exists():
            return read_json(side)["stats"]["kept"], "built"
    except EagletError:  # the raw file is not there yet: its key cannot be computed
        pass
    return d.get("max_samples"), "max_samples"


def dataset_plan(keys: Keys, ds: str, token_bytes: float) -> dict:
    """The numbers of one dataset (None where the params do not say)."""
    p = keys.params
    d, gen = p.dataset(ds), p.generation(ds)
    backend = p.backend(gen["backend"])
    n, source = _prompts(keys, ds)
    expect = d.get("expect", {})
    max_len = p.max_length(ds)
    prompt_cap = d.get("max_prompt_tokens", p.data["prompts"].get("max_prompt_tokens"))

    def capped(x: float | None, cap: float | None) -> float | None:
        return None if x is None else (x if cap is None else min(x, cap))

    mean_c, mean_p = expect.get("completion_tokens"), expect.get("prompt_tokens")
    budget = d.get("token_budget")
    # samples answered: all prompts, or as many as the token budget lets through
    n_exp = capped(n, budget / mean_c if budget and mean_c else None) if mean_c else None
    tok = {
        "expected": n_exp * mean_c if n_exp is not None else None,
        "max": capped(n * gen["max_new_tokens"] if n else None, budget),
    }
    price = backend.get("price_per_mtok") if backend["kind"] == "openai" else None
    cost: dict = {"expected": None, "max": None}
    if backend["kind"] != "openai":
        cost = {"expected": 0.0, "max": 0.0}
    elif price:
        for k, answered in (("expected", n_exp), ("max", n)):
            if tok[k] is not None:
                prompt_tokens = answered * mean_p if answered and mean_p else 0
                usd = tok[k] * price.get("completion", 0) + prompt_tokens * price.get("prompt", 0)
                cost[k] = capped(usd / 1e6, d.get("max_cost_usd"))
    per_sample_max = min(max_len, (prompt_cap or max_len) + gen["max_new_tokens"])
    hidden_tokens = {
        "expected": n_exp * min(max_len, mean_p + mean_c) if n_exp and mean_p else None,
        "max": n * per_sample_max if n else None,
    }
    if tok["max"] is not None and hidden_tokens["max"] is not None and prompt_cap:
        hidden_tokens["max"] = min(hidden_tokens["max"], tok["max"] + n * prompt_cap)
    return {
        "dataset": ds,
        "backend": gen["backend"],
        "prompts": n,
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


def plan(params: Params, target_config: Path | None = None, gpu_memory: float = 96 * 2**30) -> dict:
    """The whole plan: per dataset, totals, the disk check and training memory per GPU."""
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
    free = shutil.disk_usage(probe).free
    fits = {k: None if v is None else v <= free for k, v in total["hidden_bytes"].items()}
    shown = os.path.relpath(probe) if probe.is_relative_to(Path.cwd()) else str(probe)
    training = training_memory(params, text, where, prefix, gpu_memory)
    return {
        "target": {"config": where, "hidden_size": width, "num_hidden_layers": layers},
        "stages": placement.stages(keys, text, where, rows, total, fits, training),
        "storage": {
            "dtype": h["dtype"],
            "fp8": h["fp8"],
            "compress": h["compress"],
            "bytes_per_token": round(token_bytes),
        },
        "datasets": rows,
        "total": total,
        "disk": {"path": shown, "free_bytes": free, "fits": fits},
        "hidden_modes": mode_rows(params, rows, free),
        "training": training,
    }


TOKEN_ID_BYTES = 5  # int32 id + bool mask: what an online manifest keeps per token


def mode_rows(params: Params, rows: list[dict], free: int) -> list[dict]:
    """Per hidden.mode: expected disk for hidden states and engine prefill tokens (one epoch and
    all training), from the datasets' expected hidden tokens and bytes."""
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
    out = []
    for mode, disk, prefill in (
        ("offline", None if shards is None else shards + ids, once),
        ("online", ids, epochs_x),
        ("hybrid", None if shards is None else shards + ids, once),
    ):
        out.append(
            {
                "mode": mode,
                "disk_bytes": disk,
                "fits": None if disk is None else disk <= free,
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
            "?" if r["prompts"] is None else f"{r['prompts']:,}",
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
            *render_modes(report),
            "",
            *render_training(report["training"]),
        ]
    )


def render_modes(report: dict) -> list[str]:
    """The hidden.mode table: disk and engine prefill per mode."""
    verdict = {True: "fits", False: "DOES NOT FIT", None: "unknown"}
    lines = [
        "| hidden.mode | hidden-state disk (exp) | engine prefill tok / epoch | prefill tok, all "
        "training |",
        "|---|---|---|---|",
    ]
    for r in report["hidden_modes"]:
        total = _num(r["prefill_tokens_total"])
        if r["repeats_each_epoch"]:
            total += " (repeated every epoch: tokens x epochs)"
        disk = f"{_num(r['disk_bytes'], 'B')} ({verdict[r['fits']]})"
        lines.append(f"| {r['mode']} | {disk} | {_num(r['prefill_tokens_per_epoch'])} | {total} |")
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
    return [*lines, "", wall, f"rates: {marked}" if marked else ""]
