"""What an edit moves: the demo's keys and the code guard after each edit of a copy of the package.

    .venv/bin/python -m benchmarks.key_moves

Each edit is applied to a fresh copy of src/eaglet; `eaglet keys --json` on the root params.yaml
gives the keys, `eaglet code` the guard's verdict. Prints one Markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bump(module: str) -> tuple[str, str, str, str]:
    """(what, file, the declaration, the declaration one version higher)."""
    text = (ROOT / "src" / "eaglet" / "stages" / module / "__init__.py").read_text()
    m = re.search(r"CODE = Code\(\n    version=(\d+),", text)
    higher = m[0].replace(f"version={m[1]}", f"version={int(m[1]) + 1}")
    return (
        f"`{module}` version {m[1]} -> {int(m[1]) + 1}",
        f"stages/{module}/__init__.py",
        m[0],
        higher,
    )


# (what, file, old text or "" to append, new text)
EDITS = [
    ("`__version__` bumped", "__init__.py", '__version__ = "0.1.0"', '__version__ = "9.9.9"'),
    ("HTTP pool size doubled", "engines/http.py", "POOL_CONNECTIONS = 16", "POOL_CONNECTIONS = 32"),
    (
        "an error message in target loading",
        "model/target.py",
        "not a model folder (no config.json)",
        "no config.json here",
    ),
    (
        "vLLM start-up timeout",
        "engines/vllm/server.py",
        "startup_timeout_s: float = 900.0",
        "startup_timeout_s: float = 1800.0",
    ),
    ("progress text (the ETA label)", "progress.py", 'f"ETA {', 'f"eta {'),
    (
        "an error message inside a kernel",
        "stages/hidden/kernel.py",
        "appears twice",
        "is there twice",
    ),
    (
        "the drafter's loss, no bump",
        "model/ttt.py",
        "return -(p * F.log_softmax(logits, dim=-1)).sum()",
        "return -((0.9 * p + 0.1 / p.shape[-1]) * F.log_softmax(logits, dim=-1)).sum()",
    ),
    _bump("prompts"),
    _bump("responses"),
    _bump("hidden"),
    _bump("vocab"),
    _bump("train"),
    _bump("evaluate"),
    _bump("export"),
]


def run(pkg: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    cmd = [sys.executable, "-m", "eaglet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def keys(pkg: Path) -> dict[tuple[str, str], str]:
    out = run(pkg, "keys", "--json", "--params", str(ROOT / "params.yaml"))
    return {(r["stage"], r["name"]): r["key"] for r in json.loads(out.stdout)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        shutil.copytree(ROOT / "src" / "eaglet", base / "eaglet")
        before = keys(base)
        print(f"{len(before)} keys on the demo params\n")
        print("| edit | keys moved | stages moved | guard (`eaglet code`) |")
        print("|---|---|---|---|")
        for i, (what, rel, old, new) in enumerate(EDITS):
            pkg = Path(tmp) / f"edit{i}"
            shutil.copytree(base, pkg)
            path = pkg / "eaglet" / rel
            text = path.read_text()
            assert old in text, (rel, old)
            path.write_text(text.replace(old, new, 1))
            after = keys(pkg)
            moved = sorted(
                {stage for (stage, name), key in after.items() if key != before[stage, name]}
            )
            count = sum(after[k] != before[k] for k in after)
            lines = [line.split() for line in run(pkg, "code").stdout.splitlines()]
            flagged = [f"{w[0]} {w[-1]}" for w in lines if w and w[-1] != "ok"]
            verdict = ", ".join(flagged) or "ok"
            print(f"| {what} | {count} | {', '.join(moved) or '-'} | {verdict} |")


if __name__ == "__main__":
    main()
