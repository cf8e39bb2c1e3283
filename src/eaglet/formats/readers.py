"""Read records from local prompt files: .jsonl, .json, .parquet (json ones optionally .gz/.zst).

`iter_rows` yields `(line_no, row, error)` with exactly one of `row` / `error` set, so callers can
count and report bad records without stopping. A record whose text is not Unicode (invalid UTF-8,
or a lone surrogate escape such as `"\\ud83d"`, which JSON allows and UTF-8 cannot encode) is such
an error: nothing after the reader has to meet it. Problems with the file as a whole (missing, a
directory, unreadable, wrong type, corrupt) raise `EagletError` with a one-line message naming
the file.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from eaglet.errors import EagletError
from eaglet.formats.io import ChunkStream

Row = tuple[int, dict | None, str | None]

_KINDS = (".jsonl", ".json", ".parquet")
_COMPRESSIONS = (".gz", ".zst")
_READ_SIZE = 1 << 16
# A surrogate code point in a decoded string (json.loads pairs valid escapes into one character,
# so any left is lone), and the JSON escape that can make one: only text holding the escape is
# searched, so clean records cost one regex scan of their bytes.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


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
        return io.BufferedReader(ChunkStream(_zstd_frames(path.open("rb"))))
    return path.open("rb")


def _zstd_frames(file: IO[bytes]) -> Iterator[bytes]:
    """Streaming zstd decoding of every frame in a file, failing on a truncated one.

    (zstandard's own stream_reader stops after the first frame unless asked not to, and ends
    silently on a truncated frame.)"""
    import zstandard

    try:
        dctx = zstandard.ZstdDecompressor()
        frame, in_frame = dctx.decompressobj(), False
        data = file.read(_READ_SIZE)
        while data:
            yield frame.decompress(data)
            in_frame = not frame.eof
            if frame.eof:  # the rest of the data, if any, starts the next frame
                data, frame = frame.unused_data, dctx.decompressobj()
            else:
                data = b""
            data = data or file.read(_READ_SIZE)
        if in_frame:
            raise zstandard.ZstdError("unexpected end of file inside a zstd frame")
    finally:
        file.close()


def _shown(text: str) -> str:
    """`text` printable on one line of UTF-8: surrogates and line breaks escaped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _lone_surrogate(value: dict) -> str | None:
    """The error of a record holding a lone surrogate (in a value or a field name), else None.
    The first one in document order is named, with the field path (`conversations.1.value`)."""
    stack: list[tuple[object, tuple]] = [(value, ())]
    while stack:
        item, at = stack.pop()
        found, where = None, "field"
        if isinstance(item, str):
            found = _SURROGATE.search(item)
        elif isinstance(item, dict):
            stack.extend((v, (*at, k)) for k, v in reversed(item.items()))
            for key in item:
                if found := _SURROGATE.search(key):
                    at, where = (*at, key), "field name"
                    break
        elif isinstance(item, list):
            stack.extend((v, (*at, i)) for i, v in reversed(list(enumerate(item))))
        if found:
            field = _shown(".".join(map(str, at)))
            code = f"\\u{ord(found.group()):04x}"
            return f"text is not valid Unicode (lone surrogate {code} in {where} {field})"
    return None


def _parse_object(text: bytes) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg}"
    except UnicodeDecodeError:
        return None, "invalid JSON: not valid UTF-8"
    if not isinstance(value, dict):
        return None, "not a JSON object"
    if _SURROGATE_ESCAPE_BYTES.search(text):
        error = _lone_surrogate(value)
        if error:
            return None, error
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
            text = io.TextIOWrapper(f, encoding="utf-8-sig").read()
        except UnicodeDecodeError:
            raise EagletError(f"{path}: invalid JSON: not valid UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise EagletError(f"{path}: invalid JSON: {e}") from None
    suspect = _SURROGATE_ESCAPE.search(text) is not None
    del text
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
        if not isinstance(item, dict):
            yield index + 1, None, "not a JSON object"
        elif suspect and (error := _lone_surrogate(item)):
            yield index + 1, None, error
        else:
            yield index + 1, item, None


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    line_no = 0
    with pq.ParquetFile(path) as pf:
        for batch in pf.iter_batches(batch_size=1024):
            try:
                rows = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8
                rows = None
            for i in range(batch.num_rows):
                line_no += 1
                if rows is not None:
                    yield line_no, rows[i], None
                    continue
                row, error = _parquet_row(batch, i)
                yield line_no, row, error


def _parquet_row(batch, i: int) -> tuple[dict | None, str | None]:
    """Row `i` of a record batch, column by column, naming the first that is not UTF-8."""
    row = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            row[name] = column[i].as_py()
        except UnicodeDecodeError:
            return None, f"text is not valid Unicode (invalid UTF-8 in field {_shown(name)})"
    return row, None


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
    File-level problems raise EagletError as soon as this is called (missing file, a directory,
    a folder on the way we may not enter, unsupported type) or while iterating (unreadable file,
    corrupt data, .json that is not a list of objects or not UTF-8).
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise EagletError(f"{path}: no such file") from None
    except OSError as e:  # a folder on the way that we may not enter, a loop of links
        raise EagletError(f"{path}: cannot read ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise EagletError(f"{path}: is a directory, not a dataset file")
    kind, compression = _file_type(path)
    if not stat.S_ISREG(mode):
        raise EagletError(f"{path}: not a regular file")
    if kind == ".jsonl":
        rows = _jsonl_rows(path, compression)
    elif kind == ".json":
        rows = _json_rows(path, compression)
    else:
        rows = _parquet_rows(path)
    what = {".gz": "gzip data", ".zst": "zstd data"}.get(compression, f"{kind[1:]} file")
    return _guarded(path, what, rows)
