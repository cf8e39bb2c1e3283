"""The eaglet command line as tests run it: `python -m eaglet` in a child process, importing
eaglet from this checkout's src/ (or another copy's: `src=`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def command(*args: str | Path, params: Path | None = None) -> list[str]:
    """`python -m eaglet ARGS [--params PARAMS]`, for Popen."""
    return [
        sys.executable,
        "-m",
        "eaglet",
        *map(str, args),
        *(["--params", str(params)] if params else []),
    ]


def environ(src: Path = SRC, **extra: str) -> dict[str, str]:
    """This process's environment, eaglet imported from `src`, `extra` variables set."""
    return {**os.environ, "PYTHONPATH": str(src), **extra}


def eaglet(
    *args: str | Path,
    params: Path | None = None,
    cwd: Path | None = None,
    src: Path = SRC,
    env: dict[str, str] | None = None,
    check: bool = False,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run the command to its end, output captured as text. It runs in `cwd`, else in the
    params file's folder; `env` replaces environ(src) whole; `check` asserts exit 0."""
    cwd = cwd or (Path(params).parent if params else None)
    r = subprocess.run(
        command(*args, params=params),
        cwd=cwd,
        env=environ(src) if env is None else env,
        capture_output=True,
        text=True,
        **kwargs,
    )
    if check:
        assert r.returncode == 0, (
            f"eaglet {' '.join(map(str, args))}: exit {r.returncode}\n{r.stderr[-3000:]}"
        )
    return r
