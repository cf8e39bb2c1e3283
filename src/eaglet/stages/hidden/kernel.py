"""What decides the hidden states' bytes: the token sequences of each response, the shard plan,
the batches run through the target, what is reused from an earlier key, and the manifest."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.hidden_store import (
    FORMAT,
    MANIFEST,
    HiddenReader,
    Storage,
)
from eaglet.formats.io import dumps
from eaglet.formats.records import SEP, conversation_of
from eaglet.graph.keys import Spec
from eaglet.model.target import TargetSpec, load_config, load_tokenizer
from eaglet.stages.hidden.spec import Setup

LAST_STATE = {
    "transformers": "hooked after the final norm",
    "sglang": "returned by the server after the final norm",
    "vllm": "last layer output from the engine, final norm applied by eaglet",
}


VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "dtype")


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

    The turns of one conversation (`<id>/<k>`, eaglet.stages.responses.turns) share a sample
    wherever the next turn's prompt, as the template renders it, starts with the sample so far:
    every token of it is then what the target saw when it generated that turn, and the sample
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


def manifest_of(
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


def sample_meta(sample: dict, shard: str | None) -> dict:
    return {
        "id": sample["id"],
        "response_sha256": sample["response_sha256"],
        "shard": shard,
        "tokens": len(sample["input_ids"]),
        "loss_tokens": sum(sample["loss_mask"]),
        "prompt_tokens": sample["prompt_tokens"],
        **({"turns": sample["turns"]} if sample.get("turns", 1) > 1 else {}),
    }


def disk_stats(shards: list[dict], tokens: int, n_aux: int, hidden: int, storage: Storage) -> dict:
    """What the shards take on disk, per token and against the uncompressed states."""
    size = sum(s["bytes"] for s in shards)
    state = (n_aux + 1) * hidden * storage.itemsize
    return {
        "shards": len(shards),
        "bytes": size,
        "bytes_per_token": round(size / tokens, 2),
        "state_bytes_per_token": state,  # (K+1)·H·itemsize, before compression
        "compression_ratio": round(size / tokens / state, 4),
    }
