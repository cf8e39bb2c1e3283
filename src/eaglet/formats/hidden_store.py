"""The hidden-states format: sharded safetensors + manifest.json, its writer and streaming reader.

A hidden-states directory holds `manifest.json` and `shard-00000.safetensors`, ... Each shard is a
plain safetensors file with four tensors per sample, named `<id>/<field>`:

    input_ids  int32 [T]         loss_mask  bool [T]
    aux        [T, K, H]         last       [T, H]

`aux` holds the outputs of the K target layers of `aux_layer_ids` (low, mid, high), `last` the
final state after the final norm. They are stored in the manifest's `dtype` (bfloat16 or
float32), or as float8 e4m3 with a float32 scale per token and layer (`aux_scale` [T, K],
`last_scale` [T]) when `storage.fp8` is set. With `storage.compress: zstd` each of `aux`/`last`
becomes a uint8 tensor holding one zstandard frame of its bytes split into byte planes (all
high bytes, then all low bytes: the exponent bytes of activations repeat and compress well).
Shards stay valid safetensors either way, so the reader touches one sample's bytes at a time.

A directory is built in a `.<name>.partial` sibling: shards are written atomically, and each
complete shard is appended to `journal.jsonl` (fsync'd), so a killed build resumes from its last
complete shard; `finish` writes the manifest, drops the journal and renames the directory into
place, so an existing directory is always a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.atomic import atomic_path, writing
from eaglet.errors import EagletError
from eaglet.formats.io import write_json

FORMAT = "eaglet-hidden/1"
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
ZSTD_LEVEL = 3
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
HIDDEN_FIELDS = ("aux", "last")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass(frozen=True)
class Storage:
    """How hidden tensors are stored: the dtype the reader returns, compression and FP8."""

    dtype: str = "bfloat16"
    compress: str = "none"  # "none" | "zstd"
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES or self.compress not in ("none", "zstd"):
            raise EagletError(f"hidden storage: unsupported {self}")

    @property
    def itemsize(self) -> int:
        """Bytes per stored element of `aux`/`last` before compression."""
        return 1 if self.fp8 else DTYPES[self.dtype].itemsize

    def token_bytes(self, n_aux: int, hidden: int) -> int:
        """Uncompressed bytes per token: hidden states, FP8 scales, int32 id, bool mask."""
        scales = 4 * (n_aux + 1) if self.fp8 else 0
        return (n_aux + 1) * hidden * self.itemsize + scales + 5

    def to_dict(self) -> dict:
        return {"compress": self.compress, "fp8": self.fp8, "zstd_level": ZSTD_LEVEL}


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 values and the float32 scale of each row (last dim): x ≈ q * scale."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / scale.unsqueeze(-1)).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def split_planes(t: torch.Tensor) -> bytes:
    """The tensor's bytes regrouped by byte position: all byte 0s, then all byte 1s, ..."""
    size = t.element_size()
    return t.contiguous().view(torch.uint8).reshape(-1, size).T.contiguous().numpy().tobytes()


def join_planes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of split_planes."""
    size = torch.empty((), dtype=dtype).element_size()
    planes = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(size, -1)
    return planes.T.contiguous().view(dtype).reshape(shape)


def encode(sample: dict, storage: Storage) -> dict[str, torch.Tensor]:
    """A sample's tensors as stored (names without the `<id>/` prefix)."""
    out = {
        "input_ids": torch.as_tensor(sample["input_ids"], dtype=torch.int32),
        "loss_mask": torch.as_tensor(sample["loss_mask"], dtype=torch.bool),
    }
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    for name in HIDDEN_FIELDS:
        x = sample[name]
        if storage.fp8:
            x, out[f"{name}_scale"] = quantize_fp8(x)
        else:
            x = x.to(DTYPES[storage.dtype])
        if storage.compress == "zstd":
            x = torch.frombuffer(bytearray(cctx.compress(split_planes(x))), dtype=torch.uint8)
        out[name] = x.contiguous()
    return out


def decode(
    get, tokens: int, n_aux: int, hidden: int, storage: Storage, dtype: str | None = None
) -> dict:
    """A sample's tensors from a `get(name)` accessor, in the contract's dtypes and shapes; the
    states in `dtype` if given (else the storage's). Read in float32, `encode` gives back the
    stored tensors exactly, FP8 included: a dequantized row's largest value is 448 x scale, whose
    scale is the stored one again (checked for every float32 mantissa; a power of 2 changes
    nothing). Read in bfloat16, an FP8 row is rounded and quantizes to another scale."""
    want = DTYPES[dtype or storage.dtype]
    kept = DTYPES[storage.dtype]
    out = {
        "input_ids": get("input_ids").long(),
        "loss_mask": get("loss_mask").bool(),
    }
    dctx = zstandard.ZstdDecompressor()
    for name, shape in (("aux", (tokens, n_aux, hidden)), ("last", (tokens, hidden))):
        x = get(name)
        stored = FP8 if storage.fp8 else kept
        if storage.compress == "zstd":
            x = join_planes(dctx.decompress(x.numpy().tobytes()), stored, shape)
        x = x.reshape(shape)
        out[name] = dequantize_fp8(x, get(f"{name}_scale"), want) if storage.fp8 else x.to(want)
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, samples: list[dict], storage: Storage) -> dict:
    """Write one shard atomically; return its manifest entry (name, bytes, sha256, counts)."""
    tensors = {}
    for s in samples:
        for name, t in encode(s, storage).items():
            tensors[f"{s['id']}/{name}"] = t
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    return {
        "name": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
    }


class PartialDir:
    """The `.<name>.partial` sibling a hidden-states directory is built in, with its journal.

    The journal's first line names the plan (a digest of what each shard will hold); a partial
    directory of another plan is discarded. Each later line is one complete shard's entry.
    """

    def __init__(self, final: Path, plan_digest: str, rerun: str = "rerun the build"):
        self.final = Path(final)
        self.path = self.final.parent / f".{self.final.name}.partial"
        self.journal = self.path / JOURNAL
        self.plan = plan_digest
        self.rerun = rerun  # what a lost build says to do, e.g. "rerun: eaglet hidden DATASET"
        self.done: dict[int, dict] = {}
        entries = self._read_journal()
        if entries is None or entries[:1] != [{"plan": plan_digest}]:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True)
            self._append({"plan": plan_digest})
        else:
            for entry in entries[1:]:
                p = self.path / entry["name"]
                if p.is_file() and p.stat().st_size == entry["bytes"]:
                    self.done[entry["index"]] = entry
            keep = {JOURNAL} | {e["name"] for e in self.done.values()}
            for p in self.path.iterdir():  # temp files and shards a kill left unrecorded
                if p.name not in keep:
                    p.unlink()
        # The folder this build writes into: if it is deleted (by a user, a cleanup) mid-run, a
        # later write would make a new, empty one (atomic_path makes parents), so the build would
        # publish a manifest naming shards that are gone. Its identity is checked instead.
        st = self.path.stat()
        self._identity = (st.st_dev, st.st_ino)

    def _lost(self, why: str) -> EagletError:
        return EagletError(f"{self.path}: {why}: the build was lost; {self.rerun}")

    def _check_folder(self) -> None:
        """Raise if the partial folder is not the one this build made or adopted."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise self._lost("the build folder vanished mid-run (deleted?)") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise self._lost("the build folder was replaced mid-run (deleted and made again?)")
        if not self.journal.is_file():
            raise self._lost(f"the build folder lost its {JOURNAL} mid-run")

    def _read_journal(self) -> list[dict] | None:
        """Complete lines of the journal; a torn last line (killed mid-append) is cut off."""
        if not self.journal.is_file():
            return None
        data = self.journal.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.journal, "r+b") as f:
                f.truncate(end)
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def _append(self, entry: dict) -> None:
        # a refused append leaves at most a torn last line, which _read_journal cuts off
        with writing(self.journal), open(self.journal, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_shard(
        self, index: int, samples: list[dict], storage: Storage, ids: bool = False
    ) -> dict:
        """Write shard `index` and journal it (with its sample ids if `ids`: a cache's index)."""
        self._check_folder()  # before the work: a vanished folder is not made again
        entry = write_shard(self.path / shard_name(index), samples, storage)
        entry["index"] = index
        if ids:
            entry["ids"] = [s["id"] for s in samples]
        self._append(entry)
        self.done[index] = entry
        return entry

    def finish(self, manifest: dict) -> Path:
        """Check the build is whole, write the manifest, drop the journal and move the directory
        into place. Whole: the folder is the one the build wrote into, its journal names this
        plan and every shard done with the same entry, and each shard is there with its size
        (digests are checked by HiddenReader when a shard is first read)."""
        self.verify()
        write_json(self.path / MANIFEST, manifest)
        self.journal.unlink()
        if self.final.exists():  # e.g. an empty directory a workflow engine made
            shutil.rmtree(self.final)
        os.replace(self.path, self.final)
        with contextlib.suppress(OSError):
            fd = os.open(self.final.parent, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return self.final

    def verify(self) -> None:
        """Raise EagletError, naming what is missing, unless every shard done is in place."""
        self._check_folder()
        try:
            entries = self._read_journal() or []
        except (OSError, ValueError):
            raise self._lost(f"its {JOURNAL} is unreadable") from None
        if entries[:1] != [{"plan": self.plan}]:
            raise self._lost(f"its {JOURNAL} is not this build's")
        journalled = {e.get("index"): e for e in entries[1:]}
        for index in sorted(self.done):
            entry = self.done[index]
            logged = journalled.get(index, {})
            if any(logged.get(k) != entry[k] for k in ("name", "bytes", "sha256")):
                raise self._lost(f"{entry['name']} is not in its {JOURNAL}")
            p = self.path / entry["name"]
            if not p.is_file():
                raise self._lost(f"{entry['name']} is missing")
            if p.stat().st_size != entry["bytes"]:
                raise self._lost(
                    f"{entry['name']} has {p.stat().st_size} bytes, written with {entry['bytes']}"
                )


class HiddenReader:
    """Stream samples of a hidden-states directory; only one sample's tensors are read at once.

    Each shard is checked against the manifest (size, then SHA-256) the first time this reader
    opens it, whatever for (states or token ids): a damaged or missing shard is an EagletError,
    never data. Hashing reads the shard once, less than decoding it does; the result is kept.
    `verify=False` skips the check (for a caller that reports damage itself, check_shards).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        self.path = Path(path)
        self.verify = verify
        self._verified: set[str] = set()
        try:
            self.manifest: dict = json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise EagletError(f"{self.path}: not a hidden-states directory") from None
        if self.manifest.get("format") != FORMAT:
            raise EagletError(f"{self.path / MANIFEST}: format is not {FORMAT}")
        m = self.manifest
        self.storage = Storage(m["dtype"], m["storage"]["compress"], m["storage"]["fp8"])
        self.hidden_size = m["target"]["hidden_size"]
        self.n_aux = len(m["aux_layer_ids"]["sglang"])
        self.ids: list[str] = [s["id"] for s in m["samples"]]
        self._meta = {s["id"]: s for s in m["samples"]}
        self._shards = {e["name"]: e for e in m.get("shards") or []}

    def _damaged(self, shard: str, what: str) -> EagletError:
        dataset = self.manifest.get("dataset") or "DATASET"
        return EagletError(f"{self.path / shard}: {what}; rebuild: eaglet hidden {dataset}")

    def _check(self, shard: str, digest: bool = True) -> None:
        """Raise unless `shard` is in place with the manifest's size and (`digest`) SHA-256,
        checked once per reader."""
        if not self.verify or shard in self._verified:
            return
        entry = self._shards.get(shard)
        if entry is None:
            raise self._damaged(shard, "not among the manifest's shards")
        p = self.path / shard
        try:
            size = p.stat().st_size
            if size != entry["bytes"]:
                what = f"{size} bytes, the manifest says {entry['bytes']}: damaged"
                raise self._damaged(shard, what)
            if digest and sha256_file(p) != entry["sha256"]:
                raise self._damaged(shard, "sha256 mismatch: damaged")
        except FileNotFoundError:
            raise self._damaged(shard, "missing") from None
        except OSError as e:
            raise self._damaged(shard, f"unreadable ({e.strerror or e})") from None
        if digest:
            self._verified.add(shard)

    def _open(self, shard: str, digest: bool = True) -> Any:
        """A safetensors handle on a shard checked against the manifest."""
        if shard is None:
            raise EagletError(
                f"{self.path}: hidden.mode {self.manifest.get('mode')}: no states stored here "
                "(they come from the engine at training)"
            )
        self._check(shard, digest)
        try:
            return safe_open(str(self.path / shard), framework="pt")
        except FileNotFoundError:
            raise self._damaged(shard, "missing") from None
        except Exception as e:  # OSError, safetensors' SafetensorError
            detail = " ".join(str(e).split())
            raise self._damaged(shard, f"unreadable ({detail})") from None

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[dict]:
        handle, opened = None, None
        try:
            for meta in self.manifest["samples"]:
                if meta["shard"] != opened:
                    handle = self._open(meta["shard"])
                    opened = meta["shard"]
                yield self._read(handle, meta)
        finally:
            del handle

    def get(self, id: str) -> dict:
        try:
            meta = self._meta[id]
        except KeyError:
            raise EagletError(f"{self.path}: no sample '{id}'") from None
        return self._read(self._open(meta["shard"]), meta)

    def read(self, ids: Iterable[str], dtype: str | None = None) -> Iterator[dict]:
        """The samples `ids` (those this directory has), in manifest order: each shard opened
        and checked once; their states in `dtype` if given (see `decode`)."""
        wanted = set(ids)
        handle, opened = None, None
        try:
            for meta in self.manifest["samples"]:
                if meta["id"] not in wanted:
                    continue
                if meta["shard"] != opened:
                    handle = self._open(meta["shard"])
                    opened = meta["shard"]
                yield self._read(handle, meta, dtype)
        finally:
            del handle

    def _read(self, handle: Any, meta: dict, dtype: str | None = None) -> dict:
        sid = meta["id"]
        try:
            tensors = decode(
                lambda name: handle.get_tensor(f"{sid}/{name}"),
                meta["tokens"],
                self.n_aux,
                self.hidden_size,
                self.storage,
                dtype,
            )
        except (zstandard.ZstdError, RuntimeError, ValueError) as e:
            raise EagletError(f"{self.path / meta['shard']}: sample {sid}: unreadable: {e}") from e
        return {"id": sid, **tensors}

    def tokens(self) -> Iterator[dict]:
        """Each sample's id, input_ids and loss_mask, no hidden state read: each shard is
        checked against the manifest's size only (its SHA-256 would read all of it: 3.9 TB for
        the vocab stage of the Kimi example; training, which reads the states, checks it)."""
        handle, opened = None, None
        for meta in self.manifest["samples"]:
            if meta["shard"] != opened:
                handle = self._open(meta["shard"], digest=False)
                opened = meta["shard"]
            sid = meta["id"]
            yield {
                "id": sid,
                "input_ids": handle.get_tensor(f"{sid}/input_ids").long(),
                "loss_mask": handle.get_tensor(f"{sid}/loss_mask").bool(),
            }

    def close(self) -> None:
        """Nothing to release (an online reader stops its engine here)."""

    def check_shards(self) -> list[str]:
        """Problems found comparing every shard's size and SHA-256 with the manifest."""
        problems = []
        for entry in self.manifest["shards"]:
            p = self.path / entry["name"]
            if not p.is_file():
                problems.append(f"{entry['name']}: missing")
            elif p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
                problems.append(f"{entry['name']}: content differs from the manifest (sha256)")
        return problems


TOKENS = "tokens.safetensors"


def write_manifest_only(out: Path, manifest: dict, samples: list[dict]) -> Path:
    """The directory of an online/hybrid hidden stage: manifest and token ids, no states."""
    with atomic_path(out, directory=True) as tmp:
        tensors = {}
        for s in samples:
            tensors[f"{s['id']}/input_ids"] = torch.as_tensor(s["input_ids"], dtype=torch.int32)
            tensors[f"{s['id']}/loss_mask"] = torch.as_tensor(s["loss_mask"], dtype=torch.bool)
        save_file(tensors, str(tmp / TOKENS), metadata={"format": FORMAT})
        entry = {"name": TOKENS, "bytes": (tmp / TOKENS).stat().st_size}
        manifest["tokens"] = entry | {"sha256": sha256_file(tmp / TOKENS)}
        write_json(tmp / MANIFEST, manifest)
    return out
