"""The hidden stage's run: the target and its engine set up, the samples planned, reused
or computed, written shard by shard with the manifest and the sidecar."""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from dataclasses import dataclass
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
    disk_stats,
    manifest_of,
    plan_shards,
    run_samples,
    sample_meta,
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
    target = Target.of(spec, setup)  # first: a target eaglet cannot read stops here
    load_s = time.monotonic() - t0
    samples, stats = _samples(spec, setup, target)
    v = spec.values
    storage = Storage(v.dtype, v.storage["compress"], v.storage["fp8"])
    if v.mode != "offline":  # the states come from the engine at training
        manifest = manifest_of(spec, target, storage, v.compute.get("dtype"), [], stats)
        manifest["samples"] = [sample_meta(s, None) for s in samples]
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
        return write_manifest_only(out, manifest, samples)
    work = _work(spec, out, target, storage, samples)
    engine = _Engine(spec, setup, target)
    t_run = time.monotonic()
    try:
        counts, forward_s = _write_shards(spec, setup, work, engine)
        compute_dtype = _compute_dtype(engine, work.reuse)
    finally:
        engine.close()
    run_s = time.monotonic() - t_run - engine.load_s
    manifest = _manifest(spec, target, work, compute_dtype, stats)
    timing = {
        "load_s": round(load_s + engine.load_s, 3),  # tokenizer and model: once per run
        "run_s": round(run_s, 3),
        "forward_s": round(forward_s, 3),
        "elapsed_s": round(time.monotonic() - t0, 3),
        "tokens_per_s": round(stats["tokens"] / max(run_s, 1e-9), 1),
    }
    # how this run got the states: beside the directory, never in it (its bytes are the same)
    origin = {k: counts[k] for k in ("reused", "computed", "resumed")}
    origin["reused_from"] = sorted(work.reuse.used)
    side = {**stats, **timing, **origin}
    write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": side})
    return work.partial.finish(manifest)


def _samples(spec: Spec[HiddenSpec], setup: Setup, target: Target) -> tuple[list[dict], dict]:
    """The training sequences of the upstream responses, and their stats."""
    samples, stats = sequences(responses(spec, setup), target, setup.responses)
    if not samples:
        raise EagletError(f"{setup.responses}: no response gives a training sequence ({stats})")
    return samples, stats


@dataclass(frozen=True)
class Work:
    """An offline run's work: the samples in shards (`plan`, indices into `samples`), the
    partial folder that journals the shards written, and the states other keys already hold."""

    samples: list[dict]
    plan: list[list[int]]
    storage: Storage
    partial: PartialDir
    reuse: Reuse


def _work(
    spec: Spec[HiddenSpec], out: Path, target: Target, storage: Storage, samples: list[dict]
) -> Work:
    """The shards planned; those a killed run completed, and the samples other keys hold,
    said on stderr."""
    v = spec.values
    ids = v.aux_layer_ids
    token_bytes = storage.token_bytes(len(ids), target.config.hidden_size)
    plan = plan_shards(samples, token_bytes, v.storage["shard_mb"] * 2**20)
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
    return Work(samples, plan, storage, partial, reuse)


class _Engine:
    """The hidden-states engine, loaded on first use: once per run, and never when every
    sample is reused. `load_s` is what loading it took."""

    def __init__(self, spec: Spec[HiddenSpec], setup: Setup, target: Target):
        self.spec, self.setup, self.target = spec, setup, target
        self.backend = None
        self.load_s = 0.0

    def get(self):
        if self.backend is None:
            t = time.monotonic()
            v, s = self.spec.values, self.setup
            self.backend = hidden_states(
                v.compute["backend"], s.engine, self.target, v.aux_layer_ids, s.threads
            )
            self.load_s += time.monotonic() - t
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


def _write_shards(
    spec: Spec[HiddenSpec], setup: Setup, work: Work, engine: _Engine
) -> tuple[Counter, float]:
    """Every shard not yet journalled, its samples reused or computed; return how many samples
    were reused, computed and resumed, and the seconds of forward passes."""
    beacon = work.partial.path / BEACON
    progress = Progress(f"hidden {spec.name}", len(work.samples), setup.quiet, "seq", beacon)
    counts, forward_s = Counter(), 0.0
    for index, shard in enumerate(work.plan):
        part = [work.samples[i] for i in shard]
        if index in work.partial.done:
            counts["resumed"] += len(part)
        else:
            states = work.reuse.take(part)
            missing = [s for s in part if s["id"] not in states]
            if missing:
                backend = engine.get()
                t = time.monotonic()
                computed = run_samples(backend, missing, setup.engine["batch_tokens"])
                forward_s += time.monotonic() - t
                states.update((s["id"], s) for s in computed)
            counts["reused"] += len(part) - len(missing)
            counts["computed"] += len(missing)
            work.partial.write_shard(index, [states[s["id"]] for s in part], work.storage)
        progress.update(len(part), tokens=sum(len(s["input_ids"]) for s in part))
    progress.close()
    return counts, forward_s


def _compute_dtype(engine: _Engine, reuse: Reuse) -> str:
    """The dtype the states were computed in: the engine's, or the reused sources' when the
    engine never loaded (the sources' backend ran with these very settings)."""
    if engine.backend is None and reuse.compute_dtype is None:  # every shard resumed
        engine.get()
    if engine.backend is not None:
        return str(engine.backend.dtype).removeprefix("torch.")
    return str(reuse.compute_dtype)


def _manifest(
    spec: Spec[HiddenSpec], target: Target, work: Work, compute_dtype: str, stats: dict
) -> dict:
    """The manifest of the shards written, each sample naming its shard; `stats` gains what
    they take on disk."""
    work.partial.verify()  # its folder vanished mid-run: fail before the sidecar, publish nothing
    shards = [work.partial.done[i] for i in range(len(work.plan))]
    for entry in shards:
        entry.pop("index")
    n_aux, hidden = len(spec.values.aux_layer_ids), target.config.hidden_size
    stats.update(disk_stats(shards, stats["tokens"], n_aux, hidden, work.storage))
    manifest = manifest_of(spec, target, work.storage, compute_dtype, shards, stats)
    manifest["samples"] = [
        sample_meta(work.samples[i], shards[n]["name"])
        for n, shard in enumerate(work.plan)
        for i in shard
    ]
    return manifest
