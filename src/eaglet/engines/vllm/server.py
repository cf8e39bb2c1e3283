"""A vLLM server eaglet starts and always stops, or one an operator runs (`Engine`).

`Engine(ServeConfig(...))` starts the server (eaglet.engines.vllm.config) on a free loopback port
in a session of its own, streams its log to a file (or to stderr, i.e. the stage's log under
Snakemake), and waits for `GET /health`. A server that exits or stays unhealthy past the start-up
timeout raises an error carrying its log tail. The server is always stopped: SIGTERM to its
process group, then SIGKILL after a grace period, from `stop()`, the context manager's exit
(exceptions and Ctrl-C), an atexit hook, a SIGTERM handler that turns SIGTERM into SystemExit,
and, if eaglet itself is killed with SIGKILL, by the reaper the server runs under
(eaglet.engines.reaper), which ends the group once its owner is gone. `Engine(url=...)` connects
to a running server instead (a GPU node started by its operator) and stops nothing.
`Engine.metrics()` is the text of `GET /metrics`, whose speculative-decoding counters
eaglet.formats.speculative's `spec_counters()` reads (the engine evaluation,
eaglet.stages.evaluate.engine).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx

from eaglet.engines.vllm.config import ServeConfig
from eaglet.errors import EagletError

TAIL_LINES = 40
STOP_GRACE_S = 20.0


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """A vLLM server for the length of a `with` block (or until `stop()`)."""

    def __init__(
        self,
        config: ServeConfig | None = None,
        *,
        url: str | None = None,
        log: str | os.PathLike | None = None,
        scratch: str | os.PathLike | None = None,
        startup_timeout_s: float = 900.0,
    ):
        if (config is None) == (url is None):
            raise ValueError("Engine needs a ServeConfig to start a server, or the url of one")
        self.config, self.log_path = config, Path(log) if log else None
        self.scratch = Path(scratch) if scratch else None  # the server's files: go with it
        self.startup_timeout_s = startup_timeout_s
        self.url = url.rstrip("/") if url else ""
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._pump: threading.Thread | None = None
        self._old_sigterm: Any = None

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def managed(self) -> bool:
        return self.config is not None

    def start(self) -> None:
        """Start the server and wait until it is healthy (or check the given URL answers)."""
        t0 = time.monotonic()
        if not self.managed:
            self._wait_healthy(deadline=t0 + 30.0)
            self.startup_s = 0.0
            return
        assert self.config is not None
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        sink: IO[str] = sys.stderr
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            sink = open(self.log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._catch_sigterm()
        atexit.register(self.stop)
        reaper = [sys.executable, "-m", "eaglet.engines.reaper", str(os.getpid())]
        reaper += [str(self.scratch), "--"] if self.scratch else ["--"]
        self.proc = subprocess.Popen(
            reaper + self.config.argv(port),
            env=self.config.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: stopped as a whole
        )
        pipe = self.proc.stdout
        self._pump = threading.Thread(target=self._stream, args=(pipe, sink), daemon=True)
        self._pump.start()
        try:
            self._wait_healthy(deadline=t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - t0, 2)

    def stop(self) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after a grace period."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        try:
            _stop_group(proc)
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
            if self._pump is not None:
                self._pump.join(timeout=5)
            self._restore_sigterm()

    def _catch_sigterm(self) -> None:
        """SIGTERM (Snakemake cancelling a job, `kill`) becomes SystemExit, so exits run."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _stream(self, pipe: IO[str], sink: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):
            for line in pipe:
                self._tail.append(line.rstrip("\n"))
                sink.write(line)
        if sink is not sys.stderr:
            sink.close()

    def _wait_healthy(self, deadline: float) -> None:
        what = self.config.model if self.config else self.url
        last: str = "no answer yet"
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise EagletError(
                        f"vLLM server for {what} exited with code {self.proc.returncode} "
                        f"during start-up{self.log_tail()}"
                    )
                try:
                    r = http.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = type(e).__name__
                if time.monotonic() > deadline:
                    if self.proc is None:
                        raise EagletError(f"{self.url}: vLLM server unreachable ({last})")
                    raise EagletError(
                        f"vLLM server for {what} not healthy after {self.startup_timeout_s:g} s "
                        f"({last}){self.log_tail()}"
                    )
                time.sleep(0.5)

    def log_tail(self) -> str:
        """The last lines the server logged, as a block to append to an error message."""
        if not self._tail:
            return " (it logged nothing)"
        where = f" ({self.log_path})" if self.log_path else ""
        return f"; its log{where} ends:\n" + "\n".join(self._tail)

    # ------------------------------------------------------------------ queries
    def metrics(self) -> str:
        """The Prometheus text of `GET /metrics`."""
        r = httpx.get(f"{self.url}/metrics", timeout=30.0, trust_env=False)
        r.raise_for_status()
        return r.text


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, wait for it to go, SIGKILL whatever is left."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    while _group_alive(pgid):  # SIGKILLed members vanish once reaped by their parents
        time.sleep(0.05)
        if time.monotonic() > deadline + 10:
            break
