"""A params error through the command line: one line, exit 2."""

from ..cli import eaglet
from ..unit.test_params import BASE


def test_cli_error_is_one_line_exit_2(tmp_path):
    (tmp_path / "params.yaml").write_text(BASE + "datasets: {a: {path: x, max_samples: -1}}")
    r = eaglet("status", params=tmp_path / "params.yaml")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "datasets.a.max_samples" in r.stderr
