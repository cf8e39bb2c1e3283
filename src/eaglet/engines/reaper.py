"""Run a server as the child of a small reaper that ends it when its owner dies.

    python -m eaglet.engines.reaper OWNER_PID [SCRATCH_DIR] -- COMMAND...

Started by eaglet.engines.vllm.server as the leader of a new process group: the server runs in
that group, and so do its workers. The reaper polls its parent; once the owner is gone (even by
SIGKILL, which runs no exit code in the owner), it sends SIGTERM to the server, waits, then
SIGKILLs the whole group, after removing the server's scratch directory (the hidden-states
spool) if one was named. It ignores SIGTERM itself, so a SIGTERM to the group (the owner's own
stop) reaches the server, and the reaper exits with the server's code once it has stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 20.0


def main(argv: list[str]) -> int:
    owner, rest = int(argv[0]), argv[1:]
    scratch = rest.pop(0) if rest and rest[0] != "--" else None
    if not rest or rest[0] != "--" or len(rest) < 2:
        sys.exit("usage: python -m eaglet.engines.reaper OWNER_PID [SCRATCH_DIR] -- COMMAND...")
    command = rest[1:]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = subprocess.Popen(command, preexec_fn=_default_signals)
    while server.poll() is None:
        if os.getppid() != owner:  # the owner died: we were re-parented
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=GRACE_S)
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            os.killpg(0, signal.SIGKILL)  # the group: the server's workers, and this reaper
        time.sleep(POLL_S)
    return server.returncode


def _default_signals() -> None:
    """The server handles SIGTERM and SIGINT as usual (the reaper ignores them)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
