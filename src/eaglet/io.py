"""Atomic file writes and zstandard-compressed JSON lines.

Every artifact is written to a temporary sibling and renamed into place, so an existing
path always holds a complete file: existence means done.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import zstandard

ZSTD_LEVEL = 10
_UMASK = os.umask(0)
os.umask(_UMASK)


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, UTF-8 kept; the form every hash is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}.tmp-"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if not directory:
            _fsync(tmp)
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared files
        if directory and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write a text file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        _fsync(path)
