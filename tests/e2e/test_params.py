"""A params error through the command line: one line, exit 2."""

import subprocess
import sys

from ..unit.test_params import BASE


def test_cli_error_is_one_line_exit_2(tmp_path):
    (tmp_path / "params.yaml").write_text(BASE + "datasets: {a: {path: x, max_samples: -1}}")
    r = subprocess.run(
        [sys.executable, "-m", "eaglet", "status", "--params", str(tmp_path / "params.yaml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "datasets.a.max_samples" in r.stderr
