"""The hidden stage's run: the target and its engine set up, the samples planned, reused
or computed, written shard by shard with the manifest and the sidecar."""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from pathlib import Path

from eaglet.engines.lookup import hidden_states
from eaglet.errors import EagletError
from eaglet.formats.hidden_store import (
    PartialDir,
    Storage,
    write_manifest_only,
)
from eaglet.formats.io import dumps, read_jsonl, write_json
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.progress import BEACON, Progress
from eaglet.stages.hidden.kernel import (
    Reuse,
    Target,
    _manifest,
    _sample_meta,
    plan_shards,
    run_samples,
    sequences,
)
from eaglet.stages.hidden.spec import HiddenSpec, Setup


def setup(
    keys: Keys, spec: Spec[HiddenSpec], threads: int | None = None, quiet: bool = False
) -> Setup:
    """Beside the spec: where things are and the engine's settings."""
    params, dataset = keys.params, spec.name
    compute, engine = spec.values.compute, dict(params.data["hidden"])
    if "device" in compute:  # eaglet runs the target: as the key resolved it
        engine |= {"device": compute["device"], "compute_dtype": compute["dtype"]}
    out, responses = keys.path("hidden", dataset), keys.path("responses", dataset)
    return Setup(out, responses, keys.target, engine, str(params.path), threads, quiet)


def responses(spec: Spec, setup: Setup) -> list[dict]:
    """The upstream response records, or an error naming what is missing."""
    if not setup.responses.exists():
        raise EagletError(f"hidden {spec.name}: responses not built yet: {setup.responses}")
    return list(read_jsonl(setup.responses))


def run(spec: Spec[HiddenSpec], setup: Setup, out: Path) -> Path:
    """Make the hidden-states directory `out` that `spec` describes; return it."""
    t0 = time.monotonic()
    v = spec.values
    target = Target.of(spec, setup)  # first: a target eaglet cannot read stops here
    load_s = time.monotonic() - t0
    records = responses(spec, setup)
    ids = v.aux_layer_ids
    samples, stats = sequences(records, target, setup.responses)
    if not samples:
        raise EagletError(f"{setup.responses}: no response gives a training sequence ({stats})")
    storage = Storage(v.dtype, v.storage["compress"], v.storage["fp8"])
    n_aux, hidden = len(ids), target.config.hidden_size
    if v.mode != "offline":  # the states come from the engine at training
        manifest = _manifest(spec, target, storage, v.compute.get("dtype"), [], stats)
        manifest["samples"] = [_sample_meta(s, None) for s in samples]
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
        return write_manifest_only(out, manifest, samples)
    plan = plan_shards(samples, storage.token_bytes(n_aux, hidden), v.storage["shard_mb"] * 2**20)
    digest = [spec.key, storage.to_dict(), ids]
    digest += [[(samples[i]["id"], samples[i]["response_sha256"]) for i in p] for p in plan]
    rerun = f"rerun: eaglet hidden {spec.name}"
    partial = PartialDir(out, hashlib.sha256(dumps(digest).encode()).hexdigest(), rerun)
    if partial.done:
        print(
            f"hidden {spec.name}: resuming: {len(partial.done)} of {len(plan)} shards complete",
            file=sys.stderr,
        )
    todo = [samples[i] for n, shard in enumerate(plan) if n not in partial.done for i in shard]
    reuse = Reuse(spec, out, todo)
    if reuse.source_of:
        n = len(set(reuse.source_of.values()))
        print(
            f"hidden {spec.name}: {len(reuse.source_of)} of {len(todo)} samples reused from "
            f"{n} other key{'s' if n > 1 else ''}",
            file=sys.stderr,
        )
    backend, model_s = None, 0.0

    def load():  # the model: once per run, only if some sample is not reused
        nonlocal model_s
        t = time.monotonic()
        engine = hidden_states(v.compute["backend"], setup.engine, target, ids, setup.threads)
        model_s += time.monotonic() - t
        return engine

    beacon = partial.path / BEACON
    progress = Progress(f"hidden {spec.name}", len(samples), setup.quiet, "seq", beacon)
    t_run, forward_s, counts = time.monotonic(), 0.0, Counter()
    try:
        for index, shard in enumerate(plan):
            part = [samples[i] for i in shard]
            if index not in partial.done:
                states = reuse.take(part)
                missing = [s for s in part if s["id"] not in states]
                if missing:
                    if backend is None:
                        backend = load()
                    t = time.monotonic()
                    computed = run_samples(backend, missing, setup.engine["batch_tokens"])
                    forward_s += time.monotonic() - t
                    states.update((s["id"], s) for s in computed)
                counts["reused"] += len(part) - len(missing)
                counts["computed"] += len(missing)
                partial.write_shard(index, [states[s["id"]] for s in part], storage)
            else:
                counts["resumed"] += len(part)
            progress.update(len(part), tokens=sum(len(s["input_ids"]) for s in part))
        if backend is None and reuse.compute_dtype is None:  # every shard resumed
            backend = load()
        if backend is not None:
            compute_dtype = str(backend.dtype).removeprefix("torch.")
        else:  # every state reused: the sources' backend ran with these very settings
            compute_dtype = str(reuse.compute_dtype)
    finally:
        if backend is not None:
            backend.close()
    progress.close()
    run_s = time.monotonic() - t_run - model_s
    load_s += model_s  # tokenizer and model: once per run
    partial.verify()  # its folder vanished mid-run: fail before the sidecar, publish nothing
    shards = [partial.done[i] for i in range(len(plan))]
    for entry in shards:
        entry.pop("index")
    stats.update(_disk_stats(shards, stats["tokens"], n_aux, hidden, storage))
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
    # how this run got the states: beside the directory, never in it (its bytes are the same)
    origin = {k: counts[k] for k in ("reused", "computed", "resumed")}
    origin["reused_from"] = sorted(reuse.used)
    side = {**stats, **timing, **origin}
    write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": side})
    return partial.finish(manifest)


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
