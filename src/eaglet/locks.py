"""One process per build: an exclusive lock file that names its holder.

`hold` takes an flock on the file (the OS drops it when the holder exits, kill -9 included) and
writes who holds it: `pid N on HOST, since WHEN`, then the command. A second holder is refused
with that line. The holder removes the file when it is done, so a file left behind is a build
that died; `holder` reads it for `eaglet status` (is that process alive?).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglet.atomic import writing  # a full or read-only folder: one line

_LINE = re.compile(r"^pid (?P<pid>\d+) on (?P<host>\S+), since (?P<since>.+)$")


class Locked(Exception):
    """Another process holds the lock; the message names it."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    since: str
    command: str

    def alive(self) -> bool | None:
        """Whether the holder's process runs; None when it is on another host (unknown here)."""
        if self.host != socket.gethostname():
            return None
        return pid_alive(self.pid)

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def hold(path: str | os.PathLike, command: str = "") -> Iterator[None]:
    """Hold the lock at `path` for this process while the block runs; raise Locked naming the
    holder if another process has it."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        f = _acquire(path)
    try:
        with writing(path):
            f.seek(0)
            f.truncate()
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
            line = f"pid {os.getpid()} on {socket.gethostname()}, since {when}\n{command}\n"
            f.write(line.encode())  # unbuffered: a refused write is not tried again on close
        yield
    finally:
        path.unlink(missing_ok=True)  # while held: whoever comes next makes a new file
        f.close()


def _acquire(path: Path):
    while True:
        f = open(path, "a+b", buffering=0)  # noqa: SIM115 (closed by hold)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            first = f.read().decode(errors="replace").strip().split("\n")[0]
            f.close()
            raise Locked(first or "another process") from None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()  # its last holder removed it between our open and flock: take the new one


def holder(path: str | os.PathLike) -> Holder | None:
    """Who holds (or held, if it died) the lock at `path`; None if there is no lock file."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    first, _, rest = text.partition("\n")
    m = _LINE.match(first.strip())
    if m is None:
        return None
    return Holder(int(m["pid"]), m["host"], m["since"], rest.strip())
