"""Content digests of files and folders, cached by (path, size, mtime) so big inputs hash once."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

from eaglet.atomic import write_text

_memo: dict[tuple, str] = {}


def cache_dir() -> Path:
    """Where eaglet keeps converted models, file digests, code ASTs (`EAGLET_CACHE` overrides)."""
    base = os.environ.get("EAGLET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "eaglet"
    )
    return Path(base)


class JsonCache:
    """A JSON object in the cache folder, read on first use and rewritten atomically on save.
    Unreadable, corrupt or unwritable only costs recomputing what it holds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dirty = False

    @functools.cached_property
    def path(self) -> Path:
        return cache_dir() / self.name  # on first use, not at import

    @functools.cached_property
    def entries(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, key: str, value: object) -> None:
        self.entries[key] = value
        self.dirty = True

    def save(self) -> None:
        if self.dirty:
            with contextlib.suppress(OSError):
                write_text(self.path, json.dumps(self.entries))
            self.dirty = False


_DIGESTS = JsonCache("digests.json")


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes. The stat-keyed cache only saves re-reading unchanged files."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = (str(path), st.st_size, st.st_mtime_ns)
    if stamp in _memo:
        return _memo[stamp]
    entry = _DIGESTS.entries.get(str(path))
    if entry and entry[:2] == [st.st_size, st.st_mtime_ns]:
        digest = entry[2]
    else:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
        _DIGESTS.put(str(path), [st.st_size, st.st_mtime_ns, digest])
        _DIGESTS.save()
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
