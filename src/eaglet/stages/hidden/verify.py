"""`eaglet hidden --verify`: re-run the target on a sample of records and compare with the
stored states. A check of an artifact, not part of making it: no code key covers this module."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from eaglet.engines.lookup import hidden_states
from eaglet.errors import EagletError
from eaglet.formats.hidden_store import HiddenReader, decode, encode
from eaglet.formats.records import conversation_of
from eaglet.graph.keys import Spec, resolve_stage
from eaglet.params import Params
from eaglet.stages.hidden.kernel import Target, run_samples, sequences
from eaglet.stages.hidden.run import responses
from eaglet.stages.hidden.spec import HiddenSpec, Setup

# Largest per-token relative error (L2 over a row) that --verify accepts: the storage's own
# rounding, or the noise of recomputing a sequence alone instead of in a batch, whichever is
# larger. Measured on SmolLM2: bf16 compute, batched vs alone, up to 0.026 (fp32: ~1e-6); an
# off-by-one aux layer is >= 0.42 away, a pre- vs post-norm confusion further.
VERIFY_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "fp8": 0.1}
COMPUTE_NOISE = {"float32": 0.0, "bfloat16": 0.1, "float16": 0.1}


def _relative_error(stored: torch.Tensor, fresh: torch.Tensor) -> float:
    """Largest over rows of ||stored - fresh|| / ||fresh|| (rows = tokens, and layers for aux)."""
    a, b = stored.float().flatten(0, -2), fresh.float().flatten(0, -2)
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
    return float(err.nan_to_num(float("inf")).max())


def verify(
    params: Params,
    dataset: str,
    path: Path | None = None,
    samples: int | None = None,
    threads: int | None = None,
) -> dict:
    """Re-run the target on a sample of records and compare with the stored states.

    Also checks every shard's SHA-256 and that the tokens and masks follow from the responses.
    Raises EagletError naming what differs; returns a report otherwise.
    """
    spec, setup = resolve_stage("hidden", params, dataset, threads=threads)
    path = Path(path) if path else setup.out
    reader = HiddenReader(path, verify=False)
    m = reader.manifest
    problems = reader.check_shards()
    records = responses(spec, setup)
    if m["responses_key"] != spec.upstream["responses"]:
        current = setup.responses.name
        problems.append(f"made from responses {m['responses_key']}, current are {current}")
    target = Target.of(spec, setup)
    n = samples or setup.engine["verify_samples"]
    picked = sorted(random.Random(0).sample(reader.ids, min(n, len(reader))))
    fresh, missing = _sequences(picked, records, target, setup)
    fresh = _recompute(spec, setup, target, m["aux_layer_ids"]["sglang"], fresh)
    tolerance = max(
        VERIFY_TOLERANCE["fp8" if reader.storage.fp8 else reader.storage.dtype],
        COMPUTE_NOISE.get(m["compute_dtype"], 0.1),
    )
    worst, differ = _compare(reader, fresh, tolerance)
    problems += missing + differ
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EagletError(f"{path}: verify failed: {'; '.join(problems[:3])}{more}")
    return {
        "path": str(path),
        "samples_checked": len(fresh),
        "shards_checked": len(m["shards"]),
        "max_relative_error": worst,
        "tolerance": tolerance,
        "ok": True,
    }


def _sequences(
    picked: list[str], records: list[dict], target: Target, setup: Setup
) -> tuple[list[dict], list[str]]:
    """The training sequences of the `picked` sample ids, made afresh from their responses (a
    sample may hold several turns: its whole conversation is read), and what could not be."""
    convs = {conversation_of(sid) for sid in picked}
    mine = [r for r in records if conversation_of(r.get("id", "")) in convs]
    problems = []
    try:
        by_id = {s["id"]: s for s in sequences(mine, target, setup.responses)[0]}
    except EagletError as e:
        problems.append(str(e))
        by_id = {}
    fresh = []
    for sid in picked:
        sample = by_id.get(sid)
        if sample is None:
            problems.append(f"sample {sid}: no usable response with this id")
        else:
            fresh.append(sample)
    return fresh, problems


def _recompute(
    spec: Spec[HiddenSpec], setup: Setup, target: Target, ids: list[int], fresh: list[dict]
) -> list[dict]:
    """The samples with their states computed again, each alone: no batch effects."""
    backend = hidden_states(
        spec.values.compute["backend"], setup.engine, target, ids, setup.threads
    )
    try:
        return run_samples(backend, fresh, batch_tokens=1)
    finally:
        backend.close()


def _compare(reader: HiddenReader, fresh: list[dict], tolerance: float) -> tuple[float, list[str]]:
    """The largest relative error of the stored states against the fresh ones (as the storage
    encodes them), and each sample that differs."""
    m, storage, problems, worst = reader.manifest, reader.storage, [], 0.0
    meta = {s["id"]: s for s in m["samples"]}
    n_aux = len(m["aux_layer_ids"]["sglang"])
    for f in fresh:
        sid = f["id"]
        try:
            stored = reader.get(sid)
        except EagletError as e:
            problems.append(str(e))
            continue
        if meta[sid]["response_sha256"] != f["response_sha256"]:
            problems.append(f"sample {sid}: response changed since the states were made")
        if stored["input_ids"].tolist() != f["input_ids"]:
            problems.append(f"sample {sid}: input_ids differ from the response's tokens")
            continue
        if stored["loss_mask"].tolist() != f["loss_mask"]:
            problems.append(f"sample {sid}: loss_mask differs from the response's turn")
        T = len(f["input_ids"])
        enc = encode(f, storage)
        expect = decode(enc.__getitem__, T, n_aux, reader.hidden_size, storage)
        for name in ("aux", "last"):
            err = _relative_error(stored[name], expect[name])
            worst = max(worst, err)
            if not err <= tolerance:
                problems.append(f"sample {sid}: {name} relative error {err:.3g} > {tolerance}")
    return worst, problems
