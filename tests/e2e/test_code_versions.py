"""The code-version guard on a copy of the package, run in a fresh interpreter as the user's
clone runs it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli import eaglet
from ..conftest import ROOT, bump_version, tiny_params, write_params
from ..unit.test_code_versions import STAGE_NAMES

PROBE = """
import json, sys
from eaglet.graph import code
from eaglet.graph.keys import STAGES, Keys
from eaglet.params import load
keys = Keys(load(sys.argv[1]))
out = {}
for stage, st in STAGES.items():
    name = keys.params.datasets[0] if st.kind == "dataset" else keys.params.drafters[0]
    out[stage] = keys.key(stage, name)
states = code.states({s: st.module for s, st in STAGES.items()})
print(json.dumps({"keys": out, "problems": [s.problem() for s in states if s.problem()]}))
"""


@pytest.fixture
def clone(tmp_path, project):
    """A copy of the package (the user's clone) and a params file of two datasets."""
    import shutil

    shutil.copytree(ROOT / "src" / "eaglet", tmp_path / "pkg" / "eaglet")
    return tmp_path / "pkg", write_params(project, tiny_params())


def _env(pkg: Path) -> dict:
    return {
        "PYTHONPATH": str(pkg),
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "EAGLET_CACHE": str(pkg.parent / "cache"),
    }


def _probe(pkg: Path, params: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(params)],
        capture_output=True,
        text=True,
        env=_env(pkg),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= 1, f"{path.name}: {old!r} not found"
    path.write_text(text.replace(old, new, count))


def _move_function(pkg: Path, name: str, src: str, dst: str, dst_module: str) -> None:
    """Cut `def name` out of module file `src` into `dst`; `src` imports it back."""
    source = (pkg / src).read_text()
    node = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name
    )
    lines = source.splitlines(keepends=True)
    body = "".join(lines[node.lineno - 1 : node.end_lineno])
    rest = "".join(lines[: node.lineno - 1] + lines[node.end_lineno :])
    anchor = "from __future__ import annotations\n"
    rest = rest.replace(anchor, f"{anchor}\nfrom {dst_module} import {name}\n", 1)
    (pkg / src).write_text(rest)
    target = (pkg / dst).read_text()
    target = target.replace(anchor, f"{anchor}\nimport random\n", 1)
    (pkg / dst).write_text(f"{target}\n\n{body}")


def test_plumbing_edits_move_no_key_and_pass_the_guard(clone):
    pkg, params = clone
    before = _probe(pkg, params)
    assert before["problems"] == []
    built = eaglet("prompts", "sg", "--params", str(params), env=_env(pkg))
    assert built.returncode == 0, built.stderr
    first = Path(built.stdout.strip()).read_bytes()
    e = pkg / "eaglet"
    _edit(e / "engines/http.py", "POOL_CONNECTIONS = 16", "POOL_CONNECTIONS = 32")
    _edit(e / "model/target.py", "not a model folder (no config.json)", "no config.json here")
    _edit(
        e / "engines/vllm/server.py",
        "startup_timeout_s: float = 900.0",
        "startup_timeout_s: float = 1800.0",
    )
    _edit(e / "progress.py", 'f"ETA {_duration(eta)}"', 'f"eta {_duration(eta)}"')
    # wording inside a kernel: an error message of the hidden stage's sequences
    _edit(e / "stages/hidden/kernel.py", "appears twice", "is there twice")
    # a kernel function moved to another module, its kernel entry following it
    _move_function(
        pkg,
        "measure_suites",
        "eaglet/stages/evaluate/run.py",
        "eaglet/formats/readers.py",
        "eaglet.formats.readers",
    )
    _edit(
        e / "stages/evaluate/__init__.py",
        '"eaglet.stages.evaluate.run:measure_suites"',
        '"eaglet.formats.readers:measure_suites"',
    )
    # a whole kernel module moved to another package, its kernel entry following it
    (e / "stages/prompts/kernel.py").rename(e / "formats/selection.py")
    _edit(
        e / "stages/prompts/run.py",
        "from eaglet.stages.prompts.kernel import",
        "from eaglet.formats.selection import",
    )
    _edit(
        e / "stages/prompts/__init__.py",
        '"eaglet.stages.prompts.kernel"',
        '"eaglet.formats.selection"',
    )
    after = _probe(pkg, params)
    assert after == before
    Path(built.stdout.strip()).unlink()  # the moved code runs, and writes the same bytes
    again = eaglet("prompts", "sg", "--params", str(params), env=_env(pkg))
    assert again.returncode == 0, again.stderr
    assert again.stdout == built.stdout and Path(again.stdout.strip()).read_bytes() == first


def test_a_loss_edit_needs_a_bump_and_the_bump_moves_train_and_below(clone):
    pkg, params = clone
    before = _probe(pkg, params)["keys"]
    train = pkg / "eaglet/stages/train/__init__.py"
    # the drafter's loss: a label-smoothed target distribution instead of the target's own
    _edit(
        pkg / "eaglet/model/ttt.py",
        "return -(p * F.log_softmax(logits, dim=-1)).sum()",
        "return -((0.9 * p + 0.1 / p.shape[-1]) * F.log_softmax(logits, dim=-1)).sum()",
    )
    edited = _probe(pkg, params)
    assert edited["keys"] == before  # no key moves by itself ...
    [problem] = edited["problems"]  # ... but `make test` fails, naming the stage and the part
    assert problem.startswith("stage train: its kernel changed (eaglet.model.ttt)")
    assert "bump CODE's version in eaglet/stages/train/__init__.py" in problem
    # and in the user's clone the stage stops before it reads anything, in one line
    run = eaglet("train", "d", "--params", str(params), env=_env(pkg))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "stage train: its kernel changed" in run.stderr
    assert eaglet("code", env=_env(pkg)).returncode == 2

    # the lock is not rewritten over an unbumped edit
    refused = eaglet("code", "--lock", env=_env(pkg))
    assert refused.returncode == 2 and "stage train" in refused.stderr

    train.write_text(bump_version(train.read_text()))
    assert eaglet("code", "--lock", env=_env(pkg)).returncode == 0
    bumped = _probe(pkg, params)
    assert bumped["problems"] == []
    moved = {s for s in STAGE_NAMES if bumped["keys"][s] != before[s]}
    assert moved == {"train", "evaluate", "sglang", "vllm"}


def test_same_bytes_records_a_refactor_without_moving_a_key(clone):
    pkg, params = clone
    before = _probe(pkg, params)["keys"]
    vocab = pkg / "eaglet/stages/vocab/kernel.py"
    _edit(vocab, "def count_tokens(", "def count_tokens(  # same sums, another spelling\n    ")
    text = vocab.read_text()
    # a refactor of a kernel that writes the same bytes: a local renamed
    tree = ast.parse(text)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "count_tokens")
    arg = fn.args.args[0].arg
    lines = text.splitlines(keepends=True)
    seg = "".join(lines[fn.lineno - 1 : fn.end_lineno]).replace(arg, "sources")
    vocab.write_text("".join(lines[: fn.lineno - 1]) + seg + "".join(lines[fn.end_lineno :]))
    assert [p.split(":")[0] for p in _probe(pkg, params)["problems"]] == ["stage vocab"]
    done = eaglet("code", "--lock", "--same-bytes", "vocab", env=_env(pkg))
    assert done.returncode == 0, done.stderr
    assert _probe(pkg, params) == {"keys": before, "problems": []}
