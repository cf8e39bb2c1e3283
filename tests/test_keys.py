import json
import shutil
import subprocess
import sys

from eaglet.keys import Keys, _closure, sidecar_of
from eaglet.params import load

from .conftest import ROOT, tiny_params, write_params


def test_closure_follows_eaglet_imports_only():
    mods = _closure("eaglet.prompts")
    assert {
        "eaglet.prompts",
        "eaglet.formats",
        "eaglet.readers",
        "eaglet.io",
        "eaglet.keys",
    } <= mods
    assert all(m == "eaglet" or m.startswith("eaglet.") for m in mods)
    assert "eaglet.generate" not in mods


def _code_keys(pkg_root, cache=None):
    """Code keys computed in a fresh interpreter that imports eaglet from `pkg_root`."""
    code = (
        "from eaglet.keys import code_key\n"
        "print(code_key('eaglet.prompts'), code_key('eaglet.generate'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(pkg_root), "PATH": "/usr/bin:/bin", "EAGLET_CACHE": str(cache)},
    )
    return out.stdout.split()


def test_code_key_cache_is_keyed_by_content(tmp_path):
    shutil.copytree(ROOT / "src" / "eaglet", tmp_path / "eaglet")
    cache = tmp_path / "cache"
    cold = _code_keys(tmp_path, cache)
    [stored] = cache.glob("code-ast-py*.json")
    assert len(json.loads(stored.read_text())) >= 10  # one entry per module parsed
    assert _code_keys(tmp_path, cache) == cold  # warm: read back, same keys
    gen = tmp_path / "eaglet" / "generate.py"
    gen.write_text(gen.read_text() + "\nRETRY_NOTE = 1\n")
    edited = _code_keys(tmp_path, cache)
    assert edited[0] == cold[0] and edited[1] != cold[1]  # new bytes miss the cache
    stored.write_text("{not json")
    assert _code_keys(tmp_path, cache) == edited  # a corrupt cache only costs a re-parse
    assert json.loads(stored.read_text())  # and is rewritten whole


def test_code_key_ignores_comments_and_formatting_not_code(tmp_path):
    shutil.copytree(ROOT / "src" / "eaglet", tmp_path / "eaglet")
    before = _code_keys(tmp_path, tmp_path / "cache")
    readers = tmp_path / "eaglet" / "readers.py"
    src = readers.read_text()
    readers.write_text("# a new comment\n" + src.replace("\n\n\n", "\n\n\n\n") + "\n# trailing\n")
    assert (
        _code_keys(tmp_path, tmp_path / "cache") == before
    )  # comments, blank lines: nothing changes
    fmt = tmp_path / "eaglet" / "formats.py"
    fmt.write_text(fmt.read_text() + "\n\ndef _new_helper():\n    return 1\n")
    after = _code_keys(tmp_path, tmp_path / "cache")
    assert after[0] != before[0]  # prompts imports formats: its key moves
    assert after[1] == before[1]  # generate does not: its key stays


def test_keys_follow_params_slices(project):
    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    p_sg, r_sg = keys.key("prompts", "sg"), keys.key("responses", "sg")
    r_dolly = keys.key("responses", "dolly")
    assert len(p_sg) == 12 and int(p_sg, 16) >= 0
    assert (
        keys.path("responses", "sg") == project / "data" / "responses" / "sg" / f"{r_sg}.jsonl.zst"
    )
    assert sidecar_of(keys.path("responses", "sg")) == keys.sidecar("responses", "sg")

    data["datasets"]["sg"]["temperature"] = 0.7  # a generation param of one dataset
    k2 = Keys(load(write_params(project, data)))
    assert k2.key("prompts", "sg") == p_sg
    assert k2.key("responses", "sg") != r_sg
    assert k2.key("responses", "dolly") == r_dolly

    data["datasets"]["sg"].pop("temperature")  # set back: the old key again
    data["backends"]["local"]["batch_size"] = 3  # speed settings are not in the key
    assert Keys(load(write_params(project, data))).key("responses", "sg") == r_sg

    data["datasets"]["sg"]["max_samples"] = 5  # a prompts param moves prompts and downstream
    k3 = Keys(load(write_params(project, data)))
    assert k3.key("prompts", "sg") != p_sg and k3.key("responses", "sg") != r_sg


def test_raw_content_not_path_or_mtime_makes_the_key(project):
    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    before = keys.key("prompts", "sg")
    raw = project / "data" / "demo" / "sharegpt.jsonl"
    shutil.copy(raw, project / "copy.jsonl")
    data["datasets"]["sg"]["path"] = "copy.jsonl"
    assert Keys(load(write_params(project, data))).key("prompts", "sg") == before
    (project / "copy.jsonl").write_text(raw.read_text() + "\n")  # blank line: different bytes
    assert Keys(load(write_params(project, data))).key("prompts", "sg") != before


def test_keys_match_across_processes(project):
    path = write_params(project, tiny_params())
    code = (
        "from eaglet.keys import Keys; from eaglet.params import load\n"
        f"print(Keys(load({str(path)!r})).key('responses', 'sg'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == Keys(load(path)).key("responses", "sg")
