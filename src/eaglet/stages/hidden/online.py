"""Hidden states without shards: training takes them from the vLLM engine (online), or from the
engine once and then from shards it writes as they come (hybrid).

In these modes the hidden stage writes a manifest-only directory: `manifest.json` (everything
but the shards: ids, response hashes, layers, storage, key) and `tokens.safetensors` (each
sample's `input_ids` and `loss_mask`, 5 bytes a token). `online_readers` turns the stage's
readers into `OnlineReader`s with HiddenReader's interface (`ids`, `manifest`, `get`, `tokens`,
`close`), so training is unaware of the mode. They share one `Source`: the same `VLLMHidden`
client and connector as the hidden stage (an engine started here, or `hidden.url`), and a
thread that fetches the states of the samples this process will ask for next (`expect`, in
the trainer's order) while the current batch trains, up to `hidden.prefetch_tokens` ahead.

A state from the engine goes through the storage's dtype (and FP8, if set) exactly as a shard
would store it, so a sample reads the same in every mode up to the engine's own noise.

Hybrid: each process journals the states it fetched as shards in `<key>.cache/.rank-<r>.partial/`
(eaglet.formats.hidden_store.PartialDir: atomic shards, fsync'd journal naming each shard's
samples), so later epochs, later runs and a run resumed after kill -9 read them; the engine
starts only if some sample is in no journal.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

from safetensors import safe_open

from eaglet.errors import EagletError
from eaglet.formats.hidden_store import (
    JOURNAL,
    TOKENS,
    HiddenReader,
    PartialDir,
    Storage,
    decode,
    encode,
    sha256_file,
)
from eaglet.formats.io import dumps
from eaglet.stages.hidden.spec import Setup

Ref = tuple[int, str]


def _checked_tokens(base: HiddenReader) -> Path:
    """The token ids of an online/hybrid folder, checked against its manifest (small: cheap)."""
    path, entry = base.path / TOKENS, base.manifest["tokens"]
    if not path.is_file() or sha256_file(path) != entry["sha256"]:
        dataset = base.manifest.get("dataset") or "DATASET"
        raise EagletError(f"{path}: missing or damaged (sha256); rebuild: eaglet hidden {dataset}")
    return path


def online_readers(setup: Setup, readers: list[HiddenReader]) -> list[OnlineReader]:
    """Readers of manifest-only directories that take the states from the engine `setup` names
    (the hidden stage's: target, engine settings)."""
    source = Source(setup, readers)
    return [OnlineReader(source, i) for i in range(len(readers))]


class OnlineReader:
    """HiddenReader's interface over one dataset of a Source."""

    def __init__(self, source: Source, index: int):
        self.source, self.index = source, index
        base = source.bases[index]
        self.path, self.manifest, self.ids = base.path, base.manifest, base.ids

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[dict]:
        return (self.get(sid) for sid in self.ids)

    def get(self, id: str) -> dict:
        return self.source.get((self.index, id))

    def tokens(self) -> Iterator[dict]:
        return (self.source.token_ids((self.index, sid)) for sid in self.ids)

    def expect(self, refs: Iterable[Ref]) -> None:
        self.source.expect(refs)

    def close(self) -> None:
        self.source.close()


class Source:
    """The engine, the prefetch thread and (hybrid) the caches of a drafter's datasets."""

    def __init__(self, setup: Setup, bases: list[HiddenReader]):
        self.setup, self.bases, self.h = setup, bases, setup.engine
        m = bases[0].manifest
        self.mode = m["mode"]
        self.n_aux, self.hidden = len(m["aux_layer_ids"]["sglang"]), m["target"]["hidden_size"]
        self.storage = Storage(m["dtype"], m["storage"]["compress"], m["storage"]["fp8"])
        self.plain = Storage(m["dtype"], "none", m["storage"]["fp8"])  # the values, no zstd
        self.rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not self.h.get("url"):
            raise EagletError(
                f"{setup.source}: hidden.mode {self.mode} with {world} training processes: "
                "name one engine for all of them with hidden.url (and hidden.spool)"
            )
        self._tokens = [safe_open(str(_checked_tokens(b)), framework="pt") for b in bases]
        self._lengths = [{s["id"]: s["tokens"] for s in b.manifest["samples"]} for b in bases]
        hybrid = self.mode == "hybrid"
        self.caches = (
            [Cache(b, self.storage, self.plain, self.rank) for b in bases] if hybrid else None
        )
        self.backend = None
        self._start = threading.Lock()
        self._cond = threading.Condition()
        self._pending: collections.deque[Ref] = collections.deque()  # asked for, in order
        self._ready: collections.deque[dict] = collections.deque()  # fetched, same order
        self._ahead_tokens = 0
        self._thread: threading.Thread | None = None
        self._pulling = False  # the prefetch thread has refs of the order left
        self._error: BaseException | None = None
        self._stop = False
        self.counts = collections.Counter()

    # ------------------------------------------------------------------ samples
    def token_ids(self, ref: Ref) -> dict:
        i, sid = ref
        try:
            ids = self._tokens[i].get_tensor(f"{sid}/input_ids").long()
            mask = self._tokens[i].get_tensor(f"{sid}/loss_mask").bool()
        except Exception:
            raise EagletError(f"{self.bases[i].path}: no sample '{sid}'") from None
        return {"id": sid, "input_ids": ids, "loss_mask": mask}

    def get(self, ref: Ref) -> dict:
        """The sample `ref`: prefetched if it was expected next, else fetched now."""
        with self._cond:
            while not self._pending and self._pulling and self._error is None:
                self._cond.wait()  # the thread is taking the next refs of the order
            if ref in itertools.islice(self._pending, 64):
                t = time.monotonic()
                while True:
                    if self._error is not None:
                        raise EagletError(f"hidden states from the engine: {self._error}")
                    if self._ready:
                        sample = self._ready.popleft()
                        head = self._pending.popleft()
                        self._ahead_tokens -= len(sample["input_ids"])
                        self._cond.notify_all()
                        if head == ref:
                            self.counts["wait_s"] += time.monotonic() - t
                            return sample
                        self.counts["skipped"] += 1  # expected, never asked for
                    else:
                        self._cond.wait()
        self.counts["unexpected"] += 1
        return self.fetch([ref])[0]

    def fetch(self, refs: list[Ref]) -> list[dict]:
        """Samples of `refs`, from the cache where it has them, else from the engine."""
        out: dict[Ref, dict] = {}
        missing = []
        for ref in dict.fromkeys(refs):
            cached = None
            if self.caches:
                i, sid = ref
                cached = self.caches[i].read(sid, self._lengths[i][sid], self.n_aux, self.hidden)
            if cached is None:
                missing.append(ref)
            else:
                out[ref] = cached
                self.counts["cache_samples"] += 1
        if missing:
            seqs = [self.token_ids(ref) for ref in missing]
            (states,) = self.engine().run([[s["input_ids"].tolist() for s in seqs]])
            for ref, s, (aux, last) in zip(missing, seqs, states, strict=True):
                raw = {**s, "aux": aux, "last": last}
                if self.caches:
                    self.caches[ref[0]].add(raw)
                out[ref] = {"id": s["id"], **self._as_stored(raw)}
                self.counts["engine_samples"] += 1
                self.counts["engine_tokens"] += len(s["input_ids"])
        return [out[ref] for ref in refs]

    def _as_stored(self, sample: dict) -> dict:
        """The values a shard would give back: the storage's dtype (and FP8) applied."""
        enc = encode(sample, self.plain)
        return decode(
            enc.__getitem__, len(sample["input_ids"]), self.n_aux, self.hidden, self.plain
        )

    def engine(self):
        """The hidden-states engine, started on first use."""
        with self._start:
            if self.backend is None:
                from eaglet.engines.lookup import hidden_states
                from eaglet.model.target import load_config

                spec, m = self.setup.target, self.bases[0].manifest
                target = SimpleNamespace(
                    spec=spec,
                    config=load_config(spec),
                    max_length=max(b.manifest["max_length"] for b in self.bases),
                )
                ids = m["aux_layer_ids"]["sglang"]
                self.backend = hidden_states(m["backend"], self.h, target, ids)
            return self.backend

    # ------------------------------------------------------------------ prefetch
    def expect(self, refs: Iterable[Ref]) -> None:
        """Fetch the samples of `refs` (the order this process will ask for them) ahead."""
        if self._thread is not None:
            raise RuntimeError("expect() once per source")
        caches = zip(self.caches or [], self.bases, strict=False)
        if not self.caches or not all(c.has_all(b.ids) for c, b in caches):
            self.engine()  # in the calling (main) thread: SIGTERM and start-up errors land here
        self._pulling = True
        self._thread = threading.Thread(target=self._prefetch, args=(iter(refs),), daemon=True)
        self._thread.start()

    def _prefetch(self, refs: Iterator[Ref]) -> None:
        chunk_size = max(1, int(self.h["concurrency"]))
        try:
            while True:
                with self._cond:
                    while self._ahead_tokens >= self.h["prefetch_tokens"] and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                chunk = list(itertools.islice(refs, chunk_size))
                if not chunk:
                    return
                tokens = [self._lengths[i][sid] for i, sid in chunk]
                with self._cond:
                    self._pending.extend(chunk)
                    self._ahead_tokens += sum(tokens)
                    self._cond.notify_all()
                samples = self.fetch(chunk)
                with self._cond:
                    self._ready.extend(samples)
                    self._cond.notify_all()
        except BaseException as e:  # surfaced by get() in the training thread
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._pulling = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the prefetch thread and the engine; write the caches' last shard."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        try:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            for cache in self.caches or []:
                cache.flush()
        finally:
            backend, self.backend = self.backend, None
            if backend is not None:
                backend.close()
            if self.counts:
                c = self.counts
                print(
                    f"hidden {self.mode}: {c['engine_samples']} samples "
                    f"({c['engine_tokens']} tokens) from the engine, {c['cache_samples']} from "
                    f"the cache; training waited {c['wait_s']:.1f} s for states",
                    file=sys.stderr,
                )
                self.counts = collections.Counter()


class Cache:
    """Hybrid mode's shards of one dataset, journalled by each process as states come in."""

    def __init__(self, base: HiddenReader, storage: Storage, plain: Storage, rank: int):
        self.root = base.path.with_name(base.path.name + ".cache")
        self.storage, self.plain = storage, plain
        self.shard_bytes = base.manifest["storage"]["shard_mb"] * 2**20
        digest = hashlib.sha256(dumps([base.manifest["key"], storage.to_dict()]).encode())
        self.partial = PartialDir(self.root / f"rank-{rank}", digest.hexdigest())
        self.index: dict[str, Path] = {}
        self.buffer: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.read_index()

    def read_index(self) -> None:
        """Index the shards every process journalled so far (complete lines only)."""
        for journal in sorted(self.root.glob(f".rank-*.partial/{JOURNAL}")):
            for line in journal.read_bytes().split(b"\n"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # the torn last line of a journal being written
                shard = journal.parent / entry.get("name", "")
                if "ids" in entry and shard.is_file() and shard.stat().st_size == entry["bytes"]:
                    self.index.update(dict.fromkeys(entry["ids"], shard))

    def has_all(self, ids: list[str]) -> bool:
        return all(sid in self.index for sid in ids)

    def read(self, sid: str, tokens: int, n_aux: int, hidden: int) -> dict | None:
        """The sample as a shard gives it back, or None if this cache does not hold it."""
        with self.lock:
            raw = self.buffer.get(sid)
            shard = self.index.get(sid)
        if raw is not None:  # fetched, its shard not written yet
            enc = encode(raw, self.plain)
            return {"id": sid, **decode(enc.__getitem__, tokens, n_aux, hidden, self.plain)}
        if shard is None:
            return None
        handle = safe_open(str(shard), framework="pt")
        tensors = decode(
            lambda name: handle.get_tensor(f"{sid}/{name}"), tokens, n_aux, hidden, self.storage
        )
        return {"id": sid, **tensors}

    def add(self, sample: dict) -> None:
        with self.lock:
            if sample["id"] in self.index or sample["id"] in self.buffer:
                return
            self.buffer[sample["id"]] = sample
            size = sum(len(s["input_ids"]) for s in self.buffer.values())
            full = size * self.storage.token_bytes(sample["aux"].shape[1], sample["last"].shape[-1])
        if full >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples as one more shard of this process."""
        with self.lock:
            samples = list(self.buffer.values())
            if not samples:
                return
            index = max(self.partial.done, default=-1) + 1
            entry = self.partial.write_shard(index, samples, self.storage, ids=True)
            shard = self.partial.path / entry["name"]
            self.index.update(dict.fromkeys(entry["ids"], shard))
            self.buffer.clear()
