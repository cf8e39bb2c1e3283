import os

import pytest

from eaglet.atomic import atomic_path
from eaglet.formats.io import read_jsonl, write_json, write_jsonl_zst


def test_jsonl_zst_round_trip(tmp_path):
    recs = [{"id": str(i), "text": "héllo " * i, "n": i} for i in range(100)]
    path = tmp_path / "a" / "x.jsonl.zst"
    assert write_jsonl_zst(path, recs) == 100
    assert list(read_jsonl(path)) == recs
    assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstandard magic


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "x.jsonl.zst"
    write_jsonl_zst(path, [{"a": 1}])

    def boom():
        yield {"a": 2}
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_jsonl_zst(path, boom())
    assert list(read_jsonl(path)) == [{"a": 1}]
    assert sorted(os.listdir(tmp_path)) == ["x.jsonl.zst"]


def test_atomic_directory(tmp_path):
    out = tmp_path / "shards"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "0.bin").write_bytes(b"x")
        assert not out.exists()
    assert (out / "0.bin").read_bytes() == b"x"
    with pytest.raises(ValueError), atomic_path(out, directory=True) as tmp:
        (tmp / "1.bin").write_bytes(b"y")
        raise ValueError
    assert sorted(os.listdir(out)) == ["0.bin"] and sorted(os.listdir(tmp_path)) == ["shards"]


def test_write_json_is_stable(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    first = (tmp_path / "a.json").read_bytes()
    write_json(tmp_path / "a.json", {"a": [1, 2], "b": 1})
    assert (tmp_path / "a.json").read_bytes() == first
