"""Keys in other processes: the same key in a fresh interpreter, and code edits in a copy of the
package that move only the keys they should."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from eaglet.graph.keys import STAGES, Keys
from eaglet.params import load

from ..cli import eaglet, environ
from ..conftest import ROOT, bump_version, tiny_params, write_params


def test_keys_match_across_processes(project):
    path = write_params(project, tiny_params())
    code = (
        "from eaglet.graph.keys import Keys; from eaglet.params import load\n"
        f"print(Keys(load({str(path)!r})).key('responses', 'sg'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == Keys(load(path)).key("responses", "sg")


# What each stage feeds (drafter stages read every dataset's hidden states).
DOWNSTREAM = {
    "prompts": {"responses"},
    "responses": {"hidden"},
    "hidden": {"vocab", "train", "evaluate"},
    "vocab": {"train"},
    "train": {"evaluate", "sglang", "vllm"},
    "evaluate": set(),
    "sglang": set(),
    "vllm": {"evaluate"},  # the engine measures acceptance with the vLLM export
}


def _and_downstream(*stages: str) -> set[str]:
    out, todo = set(), list(stages)
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(DOWNSTREAM[s])
    return out


def _demo_keys(pkg_root: Path, cache: Path) -> dict[tuple[str, str], str]:
    """`eaglet keys --json` on the demo's params.yaml, with the eaglet package at `pkg_root`."""
    env = environ(pkg_root, EAGLET_CACHE=str(cache))
    out = eaglet("keys", "--json", params=ROOT / "params.yaml", env=env, check=True)
    return {(r["stage"], r["name"]): r["key"] for r in json.loads(out.stdout)}


def _bump(module: str) -> tuple[str, str, str]:
    """(file, its source, the source with the stage's version one higher)."""
    text = (ROOT / "src" / "eaglet" / "stages" / module / "__init__.py").read_text()
    return (f"stages/{module}/__init__.py", text, bump_version(text))


# (file, old text or "" to append, new text, stages whose keys must move): plumbing and kernel
# edits move none (the guard of tests/unit/test_code_versions.py catches a kernel edited without a
# bump); a stage's version bump moves that stage and its downstream, nothing else.
EDITS = [
    ("__init__.py", '__version__ = "0.1.0"', '__version__ = "9.9.9"', set()),
    ("stages/responses/preflight.py", "requests to send", "requests that would go out", set()),
    ("progress.py", 'f"ETA {', 'f"eta {', set()),
    ("reports/status.py", '"stale"', '"out of date"', set()),
    ("cli.py", "every artifact's current key", "the current key of every artifact", set()),
    ("graph/keys.py", "KEY_LEN = 12", "KEY_LEN: int = 12", set()),
    ("engines/http.py", "POOL_CONNECTIONS = 16", "POOL_CONNECTIONS = 32", set()),
    ("model/drafter.py", "", "\nLAYER_NOTE = 1\n", set()),
    (*_bump("prompts"), _and_downstream("prompts")),
    (*_bump("responses"), _and_downstream("responses")),
    (*_bump("hidden"), _and_downstream("hidden")),
    (*_bump("vocab"), _and_downstream("vocab")),
    (*_bump("train"), _and_downstream("train")),
    (*_bump("evaluate"), {"evaluate"}),
    (*_bump("export"), {"sglang", "vllm", "evaluate"}),
]


def test_plumbing_edits_move_no_key_and_version_bumps_move_their_stage_and_downstream(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(ROOT / "src" / "eaglet", tmp_path / "base" / "eaglet")
    base = _demo_keys(tmp_path / "base", cache)
    assert {stage for stage, _ in base} == set(STAGES)  # every stage of the demo keyed
    for i, (rel, old, new, expected) in enumerate(EDITS):
        pkg = tmp_path / f"edit{i}"
        shutil.copytree(tmp_path / "base", pkg)
        path = pkg / "eaglet" / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1) if old else text + new)
        keys = _demo_keys(pkg, cache)
        moved = {stage for (stage, name), key in keys.items() if base[stage, name] != key}
        assert moved == expected, rel
        for (stage, name), key in keys.items():  # a moved stage moves for every name
            assert (key != base[stage, name]) == (stage in expected), (rel, stage, name)
