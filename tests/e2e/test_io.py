"""A writer killed with SIGKILL mid-write leaves nothing at the target."""

import signal
import subprocess
import sys


def test_kill_9_mid_write_leaves_nothing_at_target(tmp_path):
    path = tmp_path / "big.jsonl.zst"
    code = f"""
import itertools, os, signal
from eaglet.formats.io import write_jsonl_zst
def recs():
    for i in itertools.count():
        if i == 20000:
            os.kill(os.getpid(), signal.SIGKILL)
        yield {{"i": i}}
write_jsonl_zst({str(path)!r}, recs())
"""
    r = subprocess.run([sys.executable, "-c", code])
    assert r.returncode == -signal.SIGKILL
    assert not path.exists()
