"""Atomic writes: every artifact is written to a temporary sibling and renamed into place, so an
existing path always holds a complete file: existence means done.

A write the filesystem refuses (full, over quota, read-only, a file-size limit) is one
`WriteFailed` naming the path, whichever library wrote it: Python's OSError, safetensors'
SafetensorError and torch's inline_container RuntimeError all come here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eaglet.errors import EagletError

# errnos that mean "the filesystem takes no more": free space (or make it writable) and rerun
REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}
# safetensors' "I/O error: No space left on device (os error 28)", or IoError(Os { code: 28 ..})
_RUST_OS = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
_TORCH_WRITE = ("inline_container", "PytorchStreamWriter")


class WriteFailed(EagletError):
    """The filesystem refused a write to `path`: `reason` in its words; `kept` says what stays
    (added by whoever knows: the stage's shards, its last checkpoint)."""

    def __init__(self, path: Path, reason: str, kept: str = ""):
        self.path, self.reason, self.kept = Path(path), reason, kept
        super().__init__(f"{path}: cannot write ({reason})" + (f"; {kept}" if kept else ""))

    def keeping(self, kept: str) -> WriteFailed:
        return WriteFailed(self.path, self.reason, kept)


def write_failure(e: BaseException, where: Path | None = None) -> str | None:
    """Why the filesystem refused a write, if `e` is such a refusal; None for any other error.
    torch names no errno: the filesystem under `where` is asked whether it is full or
    read-only."""
    if isinstance(e, OSError) and e.errno in REFUSED:
        return os.strerror(e.errno)
    if type(e).__name__ == "SafetensorError" and (m := _RUST_OS.search(str(e))):
        code = int(m[1] or m[2])
        return os.strerror(code) if code in REFUSED else None
    if isinstance(e, RuntimeError) and any(t in str(e) for t in _TORCH_WRITE):
        return _probe(where) or "file write failed"
    return None


def _probe(where: Path | None) -> str | None:
    """ENOSPC or EROFS if the filesystem under `where` is full or read-only now."""
    while where is not None and not where.exists() and where != where.parent:
        where = where.parent
    if where is None:
        return None
    try:
        fs = os.statvfs(where)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if fs.f_bavail * fs.f_frsize < (1 << 20):  # under a MiB: what a failed write leaves
        return os.strerror(errno.ENOSPC)
    return None


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn a refused write inside the block into WriteFailed naming `path`."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:
        reason = write_failure(e, Path(path).parent)
        if reason is None:
            raise
        raise WriteFailed(Path(path), reason) from None


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.
    A refused write (full, read-only ...) is WriteFailed naming `path` (and the file of a
    directory's that failed); the temporary is removed and an older `path` stays."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{path.name}.tmp-"
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=path.parent)
            os.close(fd)
            tmp = Path(name)
    try:
        with writing(path):
            yield tmp
            if not directory:
                _fsync(tmp)
                os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared files
            if directory and path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except WriteFailed as e:
        _remove(tmp)
        if e.path.is_relative_to(tmp):  # a file inside the folder: name it under `path`
            raise WriteFailed(path / e.path.relative_to(tmp), e.reason) from None
        raise
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write a text file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        _fsync(path)
