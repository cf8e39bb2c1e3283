"""The prompts stage in other processes: ids stable across interpreters, and the command line's
errors."""

import hashlib
import subprocess
import sys

import pytest

from eaglet.formats.io import read_jsonl
from eaglet.formats.records import prompt_id

from ...cli import eaglet
from ...conftest import write_params
from ...unit.test_prompts import FORMATS, run_stage


def test_ids_are_content_hashes_stable_across_processes(tmp_path):
    src = FORMATS / "sharegpt.jsonl"
    outs, _ = run_stage(tmp_path, {"d": {"path": str(src), "format": "sharegpt"}})
    ids = [r["id"] for r in read_jsonl(outs["d"])]
    code = (
        "from eaglet.formats.datasets import prompt_of, to_messages, tools_of;"
        "from eaglet.formats.readers import iter_rows;"
        "from eaglet.formats.records import prompt_id\n"
        f"for _, row, err in iter_rows({str(src)!r}):\n"
        "    try: print(prompt_id(prompt_of(to_messages(row, 'sharegpt')), tools_of(row)))\n"
        "    except Exception: pass"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert sorted(ids) == sorted(set(other.stdout.split()))
    msgs = [{"role": "user", "content": "hi"}]
    canonical = b'[{"content":"hi","role":"user"}]'  # sorted keys, no spaces, UTF-8
    assert prompt_id(msgs) == hashlib.sha256(canonical).hexdigest()[:16]


@pytest.mark.parametrize(
    ("content", "fmt", "expected"),
    [
        (None, "auto", "no such file"),
        (
            '{"foo": 1}\n{"bar": 2}\n',
            "auto",
            "no valid prompt in 2 rows (first: line 1: unrecognised",
        ),
        ("not json\n", "dolly", "no valid prompt in 1 rows (first: line 1: invalid JSON"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, fmt, expected):
    if content is not None:
        (tmp_path / "d.jsonl").write_text(content)
    write_params(
        tmp_path,
        {
            "target": {"model": "smollm2-135m-instruct"},
            "datasets": {"d": {"path": "d.jsonl", "format": fmt}},
        },
    )
    r = eaglet("prompts", "d", params=tmp_path / "params.yaml")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    assert expected in r.stderr and "d.jsonl" in r.stderr
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.zst"))


def test_cli_reports_bad_rows_with_line_numbers_and_prints_path(tmp_path):
    src = FORMATS / "sharegpt.jsonl"
    write_params(
        tmp_path,
        {
            "target": {"model": "smollm2-135m-instruct"},
            "datasets": {"d": {"path": str(src), "format": "sharegpt"}},
        },
    )
    r = eaglet("prompts", "d", params=tmp_path / "params.yaml")
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.endswith(".jsonl.zst") and "/data/prompts/d/" in out
    skipped = [ln for ln in r.stderr.splitlines() if "skipped" in ln]
    assert skipped and all(f"{src}:" in ln for ln in skipped)
    r2 = eaglet("prompts", "d", "--key", "000000000000", params=tmp_path / "params.yaml")
    assert r2.returncode == 2 and "not the current key" in r2.stderr
