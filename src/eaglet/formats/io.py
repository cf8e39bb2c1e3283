"""The byte formats of eaglet's files: canonical JSON, pretty JSON, zstandard JSON lines.

These decide an artifact's bytes, so they are compute code (in the code keys); the atomic
writes under them (`eaglet.atomic`) are not.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import zstandard

from eaglet.atomic import atomic_path, write_text
from eaglet.errors import EagletError

ZSTD_LEVEL = 10


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, UTF-8 kept; the form every hash is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write pretty, sorted JSON (stable bytes for the same object)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# A JSON-lines artifact is zstandard frames of at most FRAME_BYTES of lines each, every frame
# with its content checksum, then one 24-byte skippable frame: the end marker, declaring the
# record count. Why a skippable frame and not a last `{"_eaglet_end": ...}` line: the records
# decompress to exactly the records (zstdcat, jq, pandas and eaglet's own input readers see no
# extra line), and the marker sits at a fixed offset from the end, so a reader checks it before
# the first record: a file cut short fails at once, even for a caller reading a prefix only.
# Why frames of bounded size: a frame's checksum is checked when the frame ends, so the reader
# holds one frame's text and yields its records only once the frame is verified (nothing
# damaged is read), in bounded memory. A file without the marker (cut short, or written by an
# eaglet before it) is damaged: rebuild it.
FRAME_BYTES = 4 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
END_MAGIC = (0x184D2A5E).to_bytes(4, "little")  # a skippable frame: zstd tools pass over it
END_TAG = b"EAGLETJL"
END_BYTES = 4 + 4 + len(END_TAG) + 8  # magic, payload size, tag, record count (uint64 LE)
_READ_SIZE = 1 << 20
_FRAME_HEADER_MAX = 18


def _end_marker(records: int) -> bytes:
    payload = END_TAG + records.to_bytes(8, "little")
    return END_MAGIC + len(payload).to_bytes(4, "little") + payload


def write_jsonl_zst(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Atomically write records as zstandard-compressed JSON lines (checksummed frames, then the
    end marker with the record count); return the count."""
    n = 0
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        lines: list[bytes] = []
        size = 0
        for rec in records:
            line = (dumps(rec) + "\n").encode("utf-8")
            lines.append(line)
            size += len(line)
            n += 1
            if size >= FRAME_BYTES:
                raw.write(cctx.compress(b"".join(lines)))
                lines, size = [], 0
        if lines:
            raw.write(cctx.compress(b"".join(lines)))
        raw.write(_end_marker(n))
    return n


def _damaged(path: Path, what: str) -> EagletError:
    detail = " ".join(what.split())  # one line
    return EagletError(f"{path}: {detail}; rebuild it")


def _verified_frames(path: Path) -> Iterator[bytes]:
    """The decompressed text of each frame of the artifact `path`, each yielded only after its
    checksum held; raises EagletError (one line) on a missing end marker, a damaged frame, or
    a line count other than the one the end marker declares (checked when the end is read)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise EagletError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        declared, frames_end = _declared(f, path)
        more = functools.partial(next, _chunks(f, frames_end), b"")
        dctx = zstandard.ZstdDecompressor()
        lines, offset, data = 0, 0, b""
        try:
            while data := _frame_header(data, more):
                if data[:4] != ZSTD_MAGIC:
                    raise _damaged(path, f"corrupt: no zstd frame at byte {offset}")
                if not zstandard.get_frame_parameters(data).has_checksum:
                    raise _damaged(path, f"corrupt: no checksum in the zstd frame at byte {offset}")
                text, data, used = _frame(dctx, data, more, path, offset)
                offset += used
                lines += text.count(b"\n")
                yield text
        except zstandard.ZstdError as e:
            raise _damaged(path, f"corrupt: zstd frame at byte {offset}: {e}") from None
        if lines != declared:
            raise _damaged(
                path, f"truncated: {lines} records where the end marker declares {declared}"
            )


def _declared(f: IO[bytes], path: Path) -> tuple[int, int]:
    """The record count that the end marker of the open file `f` declares, and the offset where
    its frames end (the marker's start)."""
    size = os.fstat(f.fileno()).st_size
    tail = b""
    if size >= END_BYTES:
        f.seek(size - END_BYTES)
        tail = f.read(END_BYTES)
        f.seek(0)
    if tail[: len(END_MAGIC)] != END_MAGIC or tail[8 : 8 + len(END_TAG)] != END_TAG:
        raise _damaged(path, "truncated: no end marker (cut short, or written by an older eaglet)")
    return int.from_bytes(tail[-8:], "little"), size - END_BYTES


def _chunks(f: IO[bytes], end: int) -> Iterator[bytes]:
    """The bytes of `f` from where it stands up to `end`, a read at a time."""
    left = end - f.tell()
    while left and (chunk := f.read(min(_READ_SIZE, left))):
        left -= len(chunk)
        yield chunk


def _frame_header(data: bytes, more: Callable[[], bytes]) -> bytes:
    """`data` read on until it holds a frame header's longest (less only at the end)."""
    while len(data) < _FRAME_HEADER_MAX and (chunk := more()):
        data += chunk
    return data


def _frame(
    dctx: zstandard.ZstdDecompressor,
    data: bytes,
    more: Callable[[], bytes],
    path: Path,
    offset: int,
) -> tuple[bytes, bytes, int]:
    """Decompress the frame that `data` starts with, reading on with `more`: its text (zstd
    checks the checksum at the frame's end), the bytes read past it, and the frame's length."""
    frame, out, used = dctx.decompressobj(), [], 0
    while True:
        used += len(data)
        out.append(frame.decompress(data))
        if frame.eof:
            rest = frame.unused_data
            return b"".join(out), rest, used - len(rest)
        data = more()
        if not data:
            raise _damaged(path, f"corrupt: the zstd frame at byte {offset} is cut")


class ChunkStream(io.RawIOBase):
    """Byte chunks from a generator, as a raw binary stream (wrap it in BufferedReader); closing
    it closes the generator."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._chunks.close()
        super().close()


def open_text(path: str | os.PathLike) -> IO[str]:
    """Open an eaglet JSON-lines artifact as verified text (user inputs go through readers).

    Whatever its name, the file must be as write_jsonl_zst writes it: a damaged one raises
    EagletError while it is read (a missing end marker on the first read)."""
    return io.TextIOWrapper(
        io.BufferedReader(ChunkStream(_verified_frames(Path(path)))), encoding="utf-8"
    )


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Stream the records of a JSON-lines artifact written by write_jsonl_zst, every one verified:
    a damaged file (cut short, a changed byte, bad JSON, written by an older eaglet) raises
    EagletError naming the file instead of yielding fewer or other records. A caller that stops
    early (itertools.islice) is still served only verified frames of a file with its end marker;
    the record count is checked when the end is read."""
    path = Path(path)
    line_no, rest = 0, b""
    for text in _verified_frames(path):
        lines = (rest + text).split(b"\n")
        rest = lines.pop()
        for line in lines:
            line_no += 1
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                detail = getattr(e, "msg", None) or type(e).__name__
                raise _damaged(path, f"corrupt: bad JSON at line {line_no} ({detail})") from None
            yield rec
    if rest:
        raise _damaged(path, f"corrupt: line {line_no + 1} has no end")
