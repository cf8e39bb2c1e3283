"""Content digests of files and folders, cached by (path, size, mtime) so big inputs hash once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

_memo: dict[tuple, str] = {}


def cache_dir() -> Path:
    """Where eaglet keeps converted models and file digests (`EAGLET_CACHE` overrides)."""
    base = os.environ.get("EAGLET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "eaglet"
    )
    return Path(base)


def _cache_file() -> Path:
    return cache_dir() / "digests.json"


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes. The stat-keyed cache only saves re-reading unchanged files."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = (str(path), st.st_size, st.st_mtime_ns)
    if stamp in _memo:
        return _memo[stamp]
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(str(path))
    if entry and entry[:2] == [st.st_size, st.st_mtime_ns]:
        digest = entry[2]
    else:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
        cache[str(path)] = [st.st_size, st.st_mtime_ns, digest]
        from eaglet.io import write_json

        with contextlib.suppress(OSError):  # a read-only cache only costs re-hashing
            write_json(cache_path, cache)
    _memo[stamp] = digest
    return digest


def tree_digest(folder: str | os.PathLike) -> str:
    """SHA-256 over the relative names and digests of every file in a folder."""
    folder = Path(folder)
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            h.update(f"{p.relative_to(folder)}\0{file_digest(p)}\n".encode())
    return h.hexdigest()


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
