"""The byte formats of eaglet's files: canonical JSON, pretty JSON, zstandard JSON lines.

These decide an artifact's bytes, so they are compute code (in the code keys); the atomic
writes under them (`eaglet.formats.atomic`) are not.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import zstandard

from eaglet.formats.atomic import atomic_path, write_text

ZSTD_LEVEL = 10


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, UTF-8 kept; the form every hash is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write pretty, sorted JSON (stable bytes for the same object)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl_zst(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Atomically write records as zstandard-compressed JSON lines; return the count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        with cctx.stream_writer(raw, closefd=False) as zw:
            for rec in records:
                zw.write((dumps(rec) + "\n").encode("utf-8"))
                n += 1
    return n


def open_text(path: str | os.PathLike) -> IO[str]:
    """Open an eaglet artifact as text, decompressing `.zst` (user inputs go through readers)."""
    path = Path(path)
    if path.suffix == ".zst":
        raw = open(path, "rb")  # noqa: SIM115 (closed by the reader)
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.TextIOWrapper(reader, encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Stream records from a JSON-lines artifact written by eaglet (`.jsonl` or `.jsonl.zst`)."""
    with open_text(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
