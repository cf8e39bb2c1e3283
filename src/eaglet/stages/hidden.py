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

Growth computes only what is new: a sample whose states another complete directory of the
dataset already holds (a sibling of the output whose provenance gives the same states,
`same_states`, listing the same id, response hash and token count) is read from it, shard by
shard with its SHA-256 checked, and written exactly as a computed one (`Reuse`); only the rest
goes through the target, which is not loaded at all when nothing is left. The directory's bytes
are the same either way; its sidecar counts `reused`, `computed` and the keys `reused_from`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from eaglet.engines.lookup import hidden_states
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.hidden_store import (
    FORMAT,
    MANIFEST,
    HiddenReader,
    PartialDir,
    Storage,
    write_manifest_only,
)
from eaglet.formats.io import dumps, read_jsonl, write_json
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model.target import TargetSpec, load_config, load_tokenizer
from eaglet.progress import BEACON, Progress
from eaglet.stages.hidden_spec import HiddenSpec, Setup
from eaglet.stages.turns import SEP, conversation_of

# How each backend gets the final state: the engines give the last layer's output, and eaglet
# applies the target's final RMSNorm (vLLM); SGLang and the hook read it after the norm.
# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.hidden:Target",
        "eaglet.stages.hidden:sequence",
        "eaglet.stages.hidden:sequences",
        "eaglet.stages.hidden:_extends",
        "eaglet.stages.turns:conversation_of",
        "eaglet.stages.hidden:plan_shards",
        "eaglet.stages.hidden:length_batches",
        "eaglet.stages.hidden:run_samples",
        "eaglet.stages.hidden:_manifest",
        "eaglet.stages.hidden:_sample_meta",
        "eaglet.stages.hidden:Reuse",
        "eaglet.stages.hidden:same_states",
        "eaglet.stages.hidden:_without",
        "eaglet.formats.hidden_store:decode",
        "eaglet.formats.hidden_store:dequantize_fp8",
        "eaglet.formats.hidden_store:join_planes",
        "eaglet.formats.hidden_store:HiddenReader.read",
        "eaglet.formats.hidden_store:Storage",
        "eaglet.formats.hidden_store:quantize_fp8",
        "eaglet.formats.hidden_store:split_planes",
        "eaglet.formats.hidden_store:encode",
        "eaglet.formats.hidden_store:write_shard",
        "eaglet.formats.hidden_store:shard_name",
        "eaglet.formats.chat",
        "eaglet.engines.transformers:TransformersHidden",
        "eaglet.engines.vllm:VLLMHidden",
        "eaglet.engines.vllm:rms_norm",
        "eaglet.engines.hidden_connector",
        "eaglet.formats.hidden_store:write_manifest_only",
    ),
)

LAST_STATE = {
    "transformers": "hooked after the final norm",
    "sglang": "returned by the server after the final norm",
    "vllm": "last layer output from the engine, final norm applied by eaglet",
}
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "dtype")


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
        return cls(setup.target, spec.values.target, spec.values.max_length)


def sequence(rec: dict, target: Target) -> tuple[dict | None, dict]:
    """Token ids and loss mask of one response record, or None and why it was skipped."""
    if rec.get("output_ids") is None:
        raise EagletError(
            "no output_ids: the responses were written by an eaglet before the target's own "
            "streams (rerun: eaglet generate; the store keeps every answer)"
        )
    info: dict[str, Any] = {"source": "output_ids"}
    mode = rec.get("chat_template_kwargs")
    prompt = prompt_ids(target.tokenizer, rec["messages"], rec.get("tools"), mode)
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
    """Samples of every usable record (record order) and counts of what happened to the rest.

    The turns of one conversation (`<id>/<k>`, eaglet.stages.turns) share a sample wherever
    the next turn's prompt, as the template renders it, starts with the sample so far: every
    token of it is then what the target saw when it generated that turn, and the sample
    supervises each turn in its own context. Where the template rewrites the history (Kimi
    drops earlier reasoning) or the sample would pass max_length, the turn starts a sample of
    its own. A sample's id is its first turn's (`<id>` for the first)."""
    samples, counts, seen = [], Counter(), set()
    last: tuple[str, dict, list[dict]] | None = None  # conversation, sample, its records
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
        counts["unfinished"] += rec.get("finish_reason") == "length"
        conv = conversation_of(rec["id"])
        if last is not None and last[0] == conv and _extends(last[1], sample, info):
            prev, recs = last[1], [*last[2], rec]
            sample["loss_mask"][: len(prev["loss_mask"])] = prev["loss_mask"]
            sample["prompt_tokens"] = prev["prompt_tokens"]
            sample["id"] = prev["id"]
            sample["response_sha256"] = hashlib.sha256(dumps(recs).encode()).hexdigest()
            sample["turns"] = len(recs)
            samples[-1] = sample
            counts["merged_turns"] += 1
            last = (conv, sample, recs)
            continue
        counts["truncated"] += info["truncated_tokens"] > 0
        counts["truncated_tokens"] += info["truncated_tokens"]
        if sample["id"] == f"{conv}{SEP}1":
            sample["id"] = conv
        samples.append(sample)
        last = (conv, sample, [rec])
    stats = {
        "records": len(records),
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        **{k: counts[k] for k in sorted(counts)},
    }
    return samples, stats


def _extends(prev: dict, sample: dict, info: dict) -> bool:
    """Whether a conversation's next turn can extend the sample so far: not cut at max_length,
    and its prompt starting with every token of the sample."""
    n = len(prev["input_ids"])
    return not info["truncated_tokens"] and sample["input_ids"][:n] == prev["input_ids"]


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


# Provenance fields that change no sample's states: the artifact's key and its inputs' keys (each
# sample is matched by its response's hash instead), the package's version (the stage's code
# version is compared), and the shard size (no per-sample byte).
NOT_PER_SAMPLE = ("key", "upstream", "eaglet_version", "params.storage.shard_mb")


def same_states(old_provenance: dict, new_provenance: dict) -> bool:
    """Whether an artifact of `old_provenance` holds each of its samples' states exactly as one
    of `new_provenance` computes them: every provenance field equal but NOT_PER_SAMPLE (a field
    added to provenance later is compared without being named here)."""
    return _without(old_provenance, NOT_PER_SAMPLE) == _without(new_provenance, NOT_PER_SAMPLE)


def _without(provenance: dict, fields: tuple[str, ...]) -> dict:
    """A copy of `provenance` as its JSON reads back, without the dotted `fields`."""
    out = json.loads(dumps(provenance))
    for field in fields:
        *path, last = field.split(".")
        node = out
        for name in path:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


class Reuse:
    """States of `samples` already in other complete hidden-states directories beside `out`
    (siblings with a sidecar and a manifest, offline, provenance `same_states` as `spec`'s).

    A sample is taken from a source whose manifest lists the same id, response hash and token
    count, and whose shard reads back with its SHA-256 and the sample's token ids. A source with
    a damaged shard is dropped at once (one stderr line); its samples not yet read come from
    another source or are computed. States are read in float32, whose re-encoding in the new
    storage gives the stored bytes back (FP8 included, see hidden_store.decode)."""

    def __init__(self, spec: Spec, out: Path, samples: list[dict]):
        self.name = spec.name
        self.sources: dict[str, HiddenReader] = {}  # key -> reader, while not dropped
        self.matches: dict[str, set[str]] = {}  # key -> ids it can give
        self.source_of: dict[str, str] = {}  # sample id -> the key it will be read from
        self.used: set[str] = set()
        self.compute_dtype: str | None = None  # the sources' (equal to the backend's)
        wanted = {s["id"]: s for s in samples}
        provenance = spec.provenance()
        for sidecar in sorted(Path(out).parent.glob("*.json")):
            path = sidecar.with_suffix("")
            if path.name == Path(out).name or not (path / MANIFEST).is_file():
                continue
            try:
                meta = json.loads(sidecar.read_text(encoding="utf-8"))
                if not same_states(meta.get("provenance") or {}, provenance):
                    continue
                reader = HiddenReader(path)
                if reader.manifest.get("mode", "offline") != "offline":
                    continue
                found = {
                    m["id"]
                    for m in reader.manifest["samples"]
                    if m["id"] in wanted
                    and m.get("shard")
                    and m.get("response_sha256") == wanted[m["id"]]["response_sha256"]
                    and m.get("tokens") == len(wanted[m["id"]]["input_ids"])
                }
            except (OSError, ValueError, KeyError, TypeError, AttributeError, EagletError):
                continue  # not a hidden-states directory this eaglet reads: not a source
            if found:
                self.sources[path.name], self.matches[path.name] = reader, found
        for key in sorted(self.sources, key=lambda k: (-len(self.matches[k]), k)):
            for sid in self.matches[key]:
                self.source_of.setdefault(sid, key)

    def take(self, part: list[dict]) -> dict[str, dict]:
        """The samples of `part` read from a source, by id, as `run_samples` gives them."""
        got: dict[str, dict] = {}
        while True:
            todo: dict[str, dict[str, dict]] = {}
            for s in part:
                key = self.source_of.get(s["id"])
                if key is not None and s["id"] not in got:
                    todo.setdefault(key, {})[s["id"]] = s
            if not todo:
                return got
            for key, group in todo.items():
                reader = self.sources[key]
                try:
                    for rec in reader.read(group, dtype="float32"):
                        s = group[rec["id"]]
                        ours = torch.as_tensor(s["input_ids"]), torch.as_tensor(s["loss_mask"])
                        if torch.equal(rec["input_ids"], ours[0]) and torch.equal(
                            rec["loss_mask"], ours[1]
                        ):
                            got[s["id"]] = {**s, "aux": rec["aux"], "last": rec["last"]}
                            self.used.add(key)
                            self.compute_dtype = reader.manifest.get("compute_dtype")
                        else:  # other tokens under the same hash: computed, never guessed
                            del self.source_of[s["id"]]
                except EagletError as e:
                    self._drop(key, str(e).split("; rebuild:")[0])

    def _drop(self, key: str, why: str) -> None:
        print(
            f"hidden {self.name}: not reusing {key}: {why}; computing its samples", file=sys.stderr
        )
        del self.sources[key]
        for sid, k in list(self.source_of.items()):
            if k == key:
                other = next((o for o in self.sources if sid in self.matches[o]), None)
                if other is None:
                    del self.source_of[sid]
                else:
                    self.source_of[sid] = other


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


def _manifest(
    spec: Spec, target: Target, storage: Storage, compute_dtype: str, shards: list, stats: dict
) -> dict:
    """The manifest of a hidden-states directory, but its samples."""
    v = spec.values
    ids, backend, mode = v.aux_layer_ids, v.compute["backend"], v.mode
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
        "storage": {**storage.to_dict(), "shard_mb": v.storage["shard_mb"]},
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
        **({"turns": sample["turns"]} if sample.get("turns", 1) > 1 else {}),
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
