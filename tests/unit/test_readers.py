"""iter_rows over every supported file type, with per-record and per-file errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from eaglet.errors import EagletError
from eaglet.formats.readers import iter_rows

from ..conftest import FIXTURES

ROWS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {"prompt": "Zürich or Genève?", "n": 3, "tags": ["a", "b"], "extra": None},
]

# Blank lines are skipped but still counted; bad lines become errors at their line number.
JSONL = (
    json.dumps(ROWS[0]) + "\n"
    "\n"
    "not json\n"
    "[1, 2]\n"
    '{"prompt": "unterminated"\n'
    "   \n" + json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2], ensure_ascii=False)  # no final \n
)
JSONL_EXPECTED = [
    (1, ROWS[0], None),
    (3, None, "invalid JSON: Expecting value"),
    (4, None, "not a JSON object"),
    (5, None, "invalid JSON: Expecting ',' delimiter"),
    (7, ROWS[1], None),
    (8, ROWS[2], None),
]


def write(path: Path, text: str) -> Path:
    data = text.encode("utf-8")
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", ["data.jsonl", "data.jsonl.gz", "data.jsonl.zst", "DATA.JSONL"])
def test_jsonl(tmp_path, name):
    path = write(tmp_path / name, JSONL)
    assert list(iter_rows(path)) == JSONL_EXPECTED


def test_jsonl_zst_with_several_frames(tmp_path):
    # `cat a.zst b.zst` and parallel compressors (pzstd, zstd -T) write several frames.
    lines = [json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3000)]
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "big.jsonl.zst"
    path.write_bytes(b"".join(compressor.compress("".join(lines[i::3]).encode()) for i in range(3)))
    rows = list(iter_rows(path))
    assert len(rows) == 3000
    assert rows[999] == (1000, {"prompt": "question 2997"}, None)
    assert rows[1000] == (1001, {"prompt": "question 1"}, None)
    assert rows[-1] == (3000, {"prompt": "question 2999"}, None)


def test_jsonl_zst_streaming_writer(tmp_path):
    path = tmp_path / "stream.jsonl.zst"
    with path.open("wb") as f, zstandard.ZstdCompressor().stream_writer(f) as writer:
        for i in range(20000):
            writer.write(json.dumps({"prompt": "x" * (i % 97), "i": i}).encode() + b"\n")
    rows = list(iter_rows(path))
    assert [row["i"] for _, row, _ in rows] == list(range(20000))


def test_jsonl_bom_and_bad_utf8(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "\xff"}\n{"prompt": "b"}\n')
    assert list(iter_rows(path)) == [
        (1, {"prompt": "a"}, None),
        (2, None, "invalid JSON: not valid UTF-8"),
        (3, {"prompt": "b"}, None),
    ]


@pytest.mark.parametrize("name", ["data.json", "data.json.gz", "data.json.zst"])
def test_json_list(tmp_path, name):
    path = write(tmp_path / name, json.dumps(ROWS, indent=2, ensure_ascii=False))
    assert list(iter_rows(path)) == [(1, ROWS[0], None), (2, ROWS[1], None), (3, ROWS[2], None)]


def test_json_object_with_one_list_key(tmp_path):
    path = write(tmp_path / "wrapped.json", json.dumps({"version": "1.0", "data": ROWS[:2]}))
    assert list(iter_rows(path)) == [(1, ROWS[0], None), (2, ROWS[1], None)]


def test_json_non_object_elements_are_row_errors(tmp_path):
    path = write(tmp_path / "mixed.json", json.dumps([ROWS[0], "oops", 3, ROWS[1]]))
    assert list(iter_rows(path)) == [
        (1, ROWS[0], None),
        (2, None, "not a JSON object"),
        (3, None, "not a JSON object"),
        (4, ROWS[1], None),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"just a string"', "expected a JSON list of objects, got str"),
        ('{"a": [1], "b": [2]}', "expected a JSON list of objects, or an object with one list"),
        ('{"a": 1}', "expected a JSON list of objects, or an object with one list"),
        ('[{"a": 1},', "invalid JSON: Expecting value"),
    ],
)
def test_json_not_a_list_of_objects(tmp_path, text, message):
    path = write(tmp_path / "bad.json", text)
    with pytest.raises(EagletError) as excinfo:
        list(iter_rows(path))
    assert str(excinfo.value).startswith(f"{path}: {message}")
    assert "\n" not in str(excinfo.value)


def test_parquet_in_batches_with_nested_columns(tmp_path):
    rows = [
        {
            "id": i,
            "conversations": [
                {"from": "human", "value": f"q{i}"},
                {"from": "gpt", "value": f"a{i}"},
            ],
            "system": None if i % 2 else "Be brief.",
        }
        for i in range(2500)
    ]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    result = list(iter_rows(path))
    assert [line_no for line_no, _, _ in result] == list(range(1, 2501))
    assert all(error is None for _, _, error in result)
    assert [row for _, row, _ in result] == rows
    first = result[0][1]
    assert type(first["conversations"]) is list and type(first["conversations"][0]) is dict


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(EagletError) as excinfo:
        iter_rows(path)  # raised at call time, before iterating
    assert str(excinfo.value) == f"{path}: no such file"


def test_directory(tmp_path):
    path = tmp_path / "dir.jsonl"
    path.mkdir()
    with pytest.raises(EagletError) as excinfo:
        iter_rows(path)
    assert str(excinfo.value) == f"{path}: is a directory, not a dataset file"


@pytest.mark.parametrize(
    ("name", "shown"),
    [("data.csv", ".csv"), ("data.csv.gz", ".csv.gz"), ("data.parquet.zst", ".parquet.zst")],
)
def test_unsupported_extension(tmp_path, name, shown):
    path = tmp_path / name
    path.write_bytes(b"a,b\n1,2\n")
    with pytest.raises(EagletError) as excinfo:
        iter_rows(path)
    assert str(excinfo.value) == (
        f"{path}: unsupported file type '{shown}' "
        "(expected .jsonl, .json, .parquet, optionally .gz/.zst)"
    )


def test_no_extension(tmp_path):
    path = tmp_path / "prompts"
    path.write_text("{}\n")
    with pytest.raises(EagletError) as excinfo:
        iter_rows(path)
    assert str(excinfo.value).startswith(f"{path}: unsupported file type ''")


def _truncated_zst() -> bytes:
    data = zstandard.ZstdCompressor().compress(JSONL.encode() * 50)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("name", "data", "what"),
    [
        ("bad.jsonl.gz", b"this is not gzip data", "gzip data"),
        ("cut.jsonl.gz", gzip.compress(JSONL.encode() * 50)[:-30], "gzip data"),
        ("bad.json.gz", b"\x1f\x8b\x08\x00garbage", "gzip data"),
        ("bad.jsonl.zst", b"this is not zstd data", "zstd data"),
        ("cut.jsonl.zst", _truncated_zst(), "zstd data"),
        ("bad.parquet", b"PAR1 not really parquet", "parquet file"),
    ],
)
def test_corrupt_files(tmp_path, name, data, what):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(EagletError) as excinfo:
        list(iter_rows(path))
    message = str(excinfo.value)
    assert message.startswith(f"{path}: corrupt or truncated {what} (")
    assert "\n" not in message


def test_fixture_files_read_cleanly():
    fixtures = sorted((FIXTURES / "formats").glob("*.jsonl"))
    assert len(fixtures) == 8
    for path in fixtures:
        rows = list(iter_rows(path))
        assert rows and all(error is None for _, _, error in rows), path
