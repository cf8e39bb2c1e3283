"""Generation through vLLM (`VLLMBackend`): `POST /v1/completions` with the prompt as token ids,
answers as token ids.

The prompt is rendered by the target's own chat template here (as for SGLang's `/generate`), so
the server's template plays no part and `output_ids` are exactly what the target generated: the
hidden stage needs no template guess. Stop ids are the target's own (tokenizer eos + generation
config), sent as `stop_token_ids`; the stop token is kept in `output_ids`, as the other engines
keep it. Requests go through the engine layer's one HTTP client (eaglet.engines.http).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx

from eaglet.device import resolve_dtype
from eaglet.engines.http import Client, Retryable, unreachable
from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids, stop_ids
from eaglet.model.target import TargetSpec, materialize


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
