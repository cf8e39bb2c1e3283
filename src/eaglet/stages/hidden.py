"""The hidden-states stage: the target re-reads every prompt + response; its features are stored.

Per response the sequence is the prompt as the target's template renders it with the
generation prompt, then exactly the tokens the target generated (`output_ids`, end token
included: the engine's, or a text answer written in the target's grammar by the responses
stage). The loss mask is True on the generated tokens only. Each sequence is cut at the
dataset's `max_length` (default `target.max_length`).

The target is run once per sequence (batched by length) and the outputs of the aux layers
(SGLang ids, default [1, N//2-1, N-4]) and the final post-norm state are stored in shards
(`eaglet.formats.hidden_store`), built in a partial directory that survives kills and resumes
shard by shard. Layer conventions: SGLang id i = output of decoder layer i = vLLM id i+1 =
index i+1 of transformers' `output_hidden_states`, whose last entry (N) is the post-norm state.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.engines.lookup import hidden_states
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.hidden_store import FORMAT, PartialDir, Storage
from eaglet.formats.io import dumps, read_jsonl, write_json
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model.target import TargetSpec, load_config, load_tokenizer
from eaglet.params import Params
from eaglet.progress import Progress

# How each backend gets the final state: the engines give the last layer's output, and eaglet
# applies the target's final RMSNorm (vLLM); SGLang and the hook read it after the norm.
LAST_STATE = {
    "transformers": "hooked after the final norm",
    "sglang": "returned by the server after the final norm",
    "vllm": "last layer output from the engine, final norm applied by eaglet",
}
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "dtype")


@dataclass(frozen=True)
class Setup:
    """How the stage runs, beside its spec: where things are and how hard to work. Changes no
    byte of the output."""

    out: Path  # where the directory lands
    responses: Path  # the upstream artifact
    target: TargetSpec  # where the target's files are (its identity is in the spec)
    engine: dict  # the hidden-states engine's settings (`hidden.*`, device and dtype resolved)
    source: str  # the params file, for errors
    threads: int | None = None
    quiet: bool = False


def resolve(
    params: Params, dataset: str, threads: int | None = None, quiet: bool = False
) -> tuple[Spec, Setup]:
    """The dataset's hidden states resolved once: the spec its key hashes, and the setup."""
    keys = Keys(params)
    spec = keys.spec("hidden", dataset)
    compute, engine = spec.values["compute"], dict(params.data["hidden"])
    if "device" in compute:  # eaglet runs the target: as the key resolved it
        engine |= {"device": compute["device"], "compute_dtype": compute["dtype"]}
    out, responses = keys.path("hidden", dataset), keys.path("responses", dataset)
    return spec, Setup(out, responses, keys.target, engine, str(params.path), threads, quiet)


class Target:
    """The target's tokenizer, text config and identity (weights are loaded by the backend)."""

    def __init__(self, target: TargetSpec, identity: dict, max_length: int):
        self.spec = target
        self.tokenizer = load_tokenizer(target)
        self.config = load_config(target)
        self.max_length = max_length
        self.vocab_rows = self.config.vocab_size
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
        self.identity = {
            **identity,
            "config_sha256": hashlib.sha256(dumps(cfg).encode()).hexdigest(),
            "num_hidden_layers": self.config.num_hidden_layers,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
        }

    @classmethod
    def of(cls, spec: Spec, setup: Setup) -> Target:
        return cls(setup.target, spec.values["target"], spec.values["max_length"])


def sequence(rec: dict, target: Target) -> tuple[dict | None, dict]:
    """Token ids and loss mask of one response record, or None and why it was skipped."""
    if rec.get("output_ids") is None:
        raise EagletError(
            "no output_ids: the responses were written by an eaglet before the target's own "
            "streams (rerun: eaglet generate; the store keeps every answer)"
        )
    info: dict[str, Any] = {"source": "output_ids"}
    prompt = prompt_ids(target.tokenizer, rec["messages"], rec.get("tools"))
    turn = list(rec["output_ids"])
    bad = [t for t in turn if not 0 <= t < target.vocab_rows]
    if bad:
        raise EagletError(f"output id {bad[0]} outside the target's {target.vocab_rows} rows")
    if not turn:
        return None, {**info, "skipped": "empty_response"}
    ids = prompt + turn
    mask = [False] * len(prompt) + [True] * len(turn)
    info["truncated_tokens"] = max(0, len(ids) - target.max_length)
    ids, mask = ids[: target.max_length], mask[: target.max_length]
    if not any(mask):
        return None, {**info, "skipped": "no_loss_tokens"}
    sample = {
        "id": rec["id"],
        "response_sha256": hashlib.sha256(dumps(rec).encode()).hexdigest(),
        "input_ids": ids,
        "loss_mask": mask,
        "prompt_tokens": len(prompt),
    }
    return sample, info


def sequences(records: list[dict], target: Target, source: Path) -> tuple[list[dict], dict]:
    """Samples of every usable record (record order) and counts of what happened to the rest."""
    samples, counts, seen = [], Counter(), set()
    for rec in records:
        if rec.get("id") in seen:
            raise EagletError(f"{source}: response {rec['id']} appears twice")
        seen.add(rec.get("id"))
        try:
            sample, info = sequence(rec, target)
        except KeyError as e:
            raise EagletError(f"{source}: response {rec.get('id')}: missing field {e}") from None
        except EagletError as e:
            raise EagletError(f"{source}: response {rec.get('id')}: {e}") from None
        counts[f"from_{info['source']}"] += 1
        if sample is None:
            counts[f"skipped_{info['skipped']}"] += 1
            continue
        counts["truncated"] += info["truncated_tokens"] > 0
        counts["truncated_tokens"] += info["truncated_tokens"]
        counts["unfinished"] += rec.get("finish_reason") == "length"
        samples.append(sample)
    stats = {
        "records": len(records),
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        **{k: counts[k] for k in sorted(counts)},
    }
    return samples, stats


def plan_shards(samples: list[dict], token_bytes: int, shard_bytes: float) -> list[list[int]]:
    """Consecutive runs of samples of about `shard_bytes` (uncompressed) each."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, s in enumerate(samples):
        n = len(s["input_ids"]) * token_bytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return [s for s in shards if s]


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that count x longest <= batch_tokens (at least one each)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def run_samples(backend, samples: list[dict], batch_tokens: int) -> list[dict]:
    """The samples with their `aux` and `last` states filled in (same order)."""
    groups = length_batches([len(s["input_ids"]) for s in samples], batch_tokens)
    results = backend.run([[samples[i]["input_ids"] for i in g] for g in groups])
    out: list[dict | None] = [None] * len(samples)
    for group, states in zip(groups, results, strict=True):
        for i, (aux, last) in zip(group, states, strict=True):
            out[i] = {**samples[i], "aux": aux, "last": last}
    return out  # type: ignore[return-value]


def responses(spec: Spec, setup: Setup) -> list[dict]:
    """The upstream response records, or an error naming what is missing."""
    if not setup.responses.exists():
        raise EagletError(f"hidden {spec.name}: responses not built yet: {setup.responses}")
    return list(read_jsonl(setup.responses))


def build(
    params: Params,
    dataset: str,
    out: Path | None = None,
    threads: int | None = None,
    quiet: bool = False,
) -> Path:
    """Write the dataset's hidden-states directory and its sidecar; return the directory."""
    spec, setup = resolve(params, dataset, threads, quiet)
    return run(spec, setup, Path(out) if out else setup.out)


def run(spec: Spec, setup: Setup, out: Path) -> Path:
    """Make the hidden-states directory `out` that `spec` describes; return it."""
    t0 = time.monotonic()
    v = spec.values
    target = Target.of(spec, setup)  # first: a target eaglet cannot read stops here
    load_s = time.monotonic() - t0
    records = responses(spec, setup)
    ids = v["aux_layer_ids"]
    samples, stats = sequences(records, target, setup.responses)
    if not samples:
        raise EagletError(f"{setup.responses}: no response gives a training sequence ({stats})")
    storage = Storage(v["dtype"], v["storage"]["compress"], v["storage"]["fp8"])
    n_aux, hidden = len(ids), target.config.hidden_size
    if v.get("mode", "offline") != "offline":  # the states come from the engine at training
        from eaglet.stages.hidden_online import write_manifest_only

        manifest = _manifest(spec, target, storage, v["compute"].get("dtype"), [], stats)
        manifest["samples"] = [_sample_meta(s, None) for s in samples]
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
        return write_manifest_only(out, manifest, samples)
    plan = plan_shards(
        samples, storage.token_bytes(n_aux, hidden), v["storage"]["shard_mb"] * 2**20
    )
    digest = [spec.key, storage.to_dict(), ids]
    digest += [[(samples[i]["id"], samples[i]["response_sha256"]) for i in p] for p in plan]
    rerun = f"rerun: eaglet hidden {spec.name}"
    partial = PartialDir(out, hashlib.sha256(dumps(digest).encode()).hexdigest(), rerun)
    if partial.done:
        print(
            f"hidden {spec.name}: resuming: {len(partial.done)} of {len(plan)} shards complete",
            file=sys.stderr,
        )
    t_load = time.monotonic()
    backend = hidden_states(v["compute"]["backend"], setup.engine, target, ids, setup.threads)
    load_s += time.monotonic() - t_load  # tokenizer and model: once per run
    progress = Progress(f"hidden {spec.name}", len(samples), quiet=setup.quiet, unit="seq")
    t_run, forward_s = time.monotonic(), 0.0
    try:
        for index, shard in enumerate(plan):
            part = [samples[i] for i in shard]
            if index not in partial.done:
                t = time.monotonic()
                states = run_samples(backend, part, setup.engine["batch_tokens"])
                forward_s += time.monotonic() - t
                partial.write_shard(index, states, storage)
            progress.update(len(part), tokens=sum(len(s["input_ids"]) for s in part))
    finally:
        backend.close()
    progress.close()
    run_s = time.monotonic() - t_run
    partial.verify()  # its folder vanished mid-run: fail before the sidecar, publish nothing
    shards = [partial.done[i] for i in range(len(plan))]
    for entry in shards:
        entry.pop("index")
    stats.update(_disk_stats(shards, stats["tokens"], n_aux, hidden, storage))
    compute_dtype = str(backend.dtype).removeprefix("torch.")
    manifest = _manifest(spec, target, storage, compute_dtype, shards, stats)
    manifest["samples"] = [
        _sample_meta(samples[i], shards[n]["name"]) for n, shard in enumerate(plan) for i in shard
    ]
    timing = {
        "load_s": round(load_s, 3),
        "run_s": round(run_s, 3),
        "forward_s": round(forward_s, 3),
        "elapsed_s": round(time.monotonic() - t0, 3),
        "tokens_per_s": round(stats["tokens"] / max(run_s, 1e-9), 1),
    }
    write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": {**stats, **timing}})
    return partial.finish(manifest)


def _manifest(
    spec: Spec, target: Target, storage: Storage, compute_dtype: str, shards: list, stats: dict
) -> dict:
    """The manifest of a hidden-states directory, but its samples."""
    v = spec.values
    ids, backend, mode = v["aux_layer_ids"], v["compute"]["backend"], v.get("mode", "offline")
    return {
        "format": FORMAT,
        "dataset": spec.name,
        "key": spec.key,
        "responses_key": spec.upstream["responses"],
        "backend": backend,
        **({"mode": mode} if mode != "offline" else {}),
        "target": target.identity,
        "max_length": target.max_length,
        "aux_layer_ids": {
            "sglang": ids,
            "vllm": [i + 1 for i in ids],
            "hf_hidden_states_index": [i + 1 for i in ids],
        },
        "last": {
            "what": "final norm output (lm_head input)",
            "hf_hidden_states_index": -1,
            "how": LAST_STATE[backend],
        },
        "dtype": storage.dtype,
        "compute_dtype": compute_dtype,
        "storage": {**storage.to_dict(), "shard_mb": v["storage"]["shard_mb"]},
        "shards": shards,
        "samples": [],
        "stats": stats,
    }


def _sample_meta(sample: dict, shard: str | None) -> dict:
    return {
        "id": sample["id"],
        "response_sha256": sample["response_sha256"],
        "shard": shard,
        "tokens": len(sample["input_ids"]),
        "loss_tokens": sum(sample["loss_mask"]),
        "prompt_tokens": sample["prompt_tokens"],
    }


def _disk_stats(shards: list[dict], tokens: int, n_aux: int, hidden: int, storage: Storage):
    size = sum(s["bytes"] for s in shards)
    state = (n_aux + 1) * hidden * storage.itemsize
    return {
        "shards": len(shards),
        "bytes": size,
        "bytes_per_token": round(size / tokens, 2),
        "state_bytes_per_token": state,  # (K+1)·H·itemsize, before compression
        "compression_ratio": round(size / tokens / state, 4),
    }
