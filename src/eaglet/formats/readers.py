"""Read records from local prompt files: .jsonl, .json, .parquet (json ones optionally .gz/.zst).

`iter_rows` yields `(line_no, row, error)` with exactly one of `row` / `error` set, so callers can
count and report bad records without stopping. Problems with the file as a whole (missing, wrong
type, corrupt) raise `EagletError` with a one-line message naming the file.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from eaglet.errors import EagletError

Row = tuple[int, dict | None, str | None]

_KINDS = (".jsonl", ".json", ".parquet")
_COMPRESSIONS = (".gz", ".zst")
_READ_SIZE = 1 << 16


def _file_type(path: Path) -> tuple[str, str]:
    """Return (kind, compression), e.g. ('.jsonl', '.zst'), or raise EagletError."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in _COMPRESSIONS else ""
    kind = suffixes[-1] if suffixes else ""
    if kind not in _KINDS or (kind == ".parquet" and compression):
        shown = kind + compression
        raise EagletError(
            f"{path}: unsupported file type '{shown}' "
            "(expected .jsonl, .json, .parquet, optionally .gz/.zst)"
        )
    return kind, compression


def _open_binary(path: Path, compression: str) -> IO[bytes]:
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        return io.BufferedReader(_ZstdReader(path.open("rb")))
    return path.open("rb")


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decoding of every frame in a file, failing on a truncated one.

    (zstandard's own stream_reader stops after the first frame unless asked not to, and ends
    silently on a truncated frame.)
    """

    def __init__(self, file: IO[bytes]):
        self._file = file
        self._chunks = self._decompress()
        self._pending = memoryview(b"")

    def _decompress(self) -> Iterator[bytes]:
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        frame, in_frame = dctx.decompressobj(), False
        data = self._file.read(_READ_SIZE)
        while data:
            yield frame.decompress(data)
            in_frame = not frame.eof
            if frame.eof:  # the rest of the data, if any, starts the next frame
                data, frame = frame.unused_data, dctx.decompressobj()
            else:
                data = b""
            data = data or self._file.read(_READ_SIZE)
        if in_frame:
            raise zstandard.ZstdError("unexpected end of file inside a zstd frame")

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
        self._file.close()
        super().close()


def _parse_object(text: str | bytes) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg}"
    except UnicodeDecodeError:
        return None, "invalid JSON: not valid UTF-8"
    if not isinstance(value, dict):
        return None, "not a JSON object"
    return value, None


def _jsonl_rows(path: Path, compression: str) -> Iterator[Row]:
    with _open_binary(path, compression) as f:
        for line_no, line in enumerate(f, start=1):
            if line_no == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # UTF-8 BOM
            if not line.strip():
                continue
            row, error = _parse_object(line)
            yield line_no, row, error


def _json_rows(path: Path, compression: str) -> Iterator[Row]:
    with _open_binary(path, compression) as f:
        try:
            data = json.load(io.TextIOWrapper(f, encoding="utf-8-sig"))
        except json.JSONDecodeError as e:
            raise EagletError(f"{path}: invalid JSON: {e}") from None
        except UnicodeDecodeError:
            raise EagletError(f"{path}: invalid JSON: not valid UTF-8") from None
    if isinstance(data, dict):
        lists = [value for value in data.values() if isinstance(value, list)]
        if len(lists) != 1:
            raise EagletError(
                f"{path}: expected a JSON list of objects, or an object with one list-valued key"
            )
        data = lists[0]
    if not isinstance(data, list):
        raise EagletError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for index, item in enumerate(data):
        if isinstance(item, dict):
            yield index + 1, item, None
        else:
            yield index + 1, None, "not a JSON object"


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    line_no = 0
    with pq.ParquetFile(path) as pf:
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                line_no += 1
                yield line_no, row, None


def _guarded(path: Path, what: str, rows: Iterator[Row]) -> Iterator[Row]:
    """Turn read / decompression / parquet failures during iteration into one-line EagletErrors."""
    try:
        yield from rows
    except EagletError:
        raise
    except PermissionError as e:
        raise EagletError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:
        # gzip: OSError/EOFError/zlib.error; zstandard: ZstdError; pyarrow: ArrowException.
        known = (OSError, EOFError, zlib.error)
        if isinstance(e, known) or type(e).__module__.startswith(("zstandard", "pyarrow")):
            detail = " ".join(str(e).split())  # keep the message on one line
            raise EagletError(f"{path}: corrupt or truncated {what} ({detail})") from None
        raise


def iter_rows(path: Path | str) -> Iterator[Row]:
    """Yield (line_no, row, error) for every record of `path`; exactly one of row/error is set.

    line_no is 1-based: the line for .jsonl, the element for .json, the row for .parquet.
    File-level problems raise EagletError as soon as this is called (missing file, unsupported
    type) or while iterating (corrupt data, .json that is not a list of objects).
    """
    path = Path(path)
    if not path.exists():
        raise EagletError(f"{path}: no such file")
    kind, compression = _file_type(path)
    if not path.is_file():
        raise EagletError(f"{path}: not a regular file")
    if kind == ".jsonl":
        rows = _jsonl_rows(path, compression)
    elif kind == ".json":
        rows = _json_rows(path, compression)
    else:
        rows = _parquet_rows(path)
    what = {".gz": "gzip data", ".zst": "zstd data"}.get(compression, f"{kind[1:]} file")
    return _guarded(path, what, rows)
