"""An SGLang server: native `POST /generate`, or its OpenAI-compatible chat route.

`/generate` gets the prompt as `input_ids`, rendered by the target's own chat template here (so
the server's template can never drift from the one the drafter is trained with), and
`sampling_params` with `max_new_tokens` always set (SGLang's default is 128). Its `output_ids` and
`meta_info` are kept; `finish_reason` comes back as an object and is normalised to its `type`.
`endpoint: chat` sends the messages to `/v1/chat/completions` and parses like the openai backend.
"""

from __future__ import annotations

from typing import Any

import httpx

from eaglet.backends.http import Client, Fatal, Retryable, unreachable
from eaglet.backends.openai import chat_body, parse_chat
from eaglet.chat import prompt_ids
from eaglet.errors import EagletError


class SGLangBackend:
    batch_size = window = 1

    def __init__(self, name: str, cfg: dict, tokenizer: Any, model: str):
        self.name, self.cfg, self.tokenizer, self.model = name, cfg, tokenizer, model
        self.concurrency = cfg["concurrency"]
        self.client = Client(cfg["url"], cfg)

    def plan(self, requests: list[dict]) -> list[list[dict]]:
        return [[r] for r in requests]

    def body(self, request: dict) -> dict:
        s = request["sampling"]
        sp: dict[str, Any] = {
            "max_new_tokens": s["max_new_tokens"],
            "temperature": s["temperature"],
            "top_p": s["top_p"],
            "top_k": s["top_k"],
        }
        if s["temperature"] > 0:
            sp["sampling_seed"] = s["seed"]
        return {"input_ids": prompt_ids(self.tokenizer, request["messages"]), "sampling_params": sp}

    async def generate(self, batch: list[dict]) -> list[dict]:
        (request,) = batch
        if self.cfg["endpoint"] == "chat":
            body = chat_body(request, "default", {})
            return [await self.client.post("/v1/chat/completions", body, self.parse_chat)]
        return [await self.client.post("/generate", self.body(request), self.parse)]

    def parse_chat(self, data: Any) -> dict:
        result = parse_chat(data, self.model, self.count)
        result["model"] = self.model
        return result

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def parse(self, data: Any) -> dict:
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict) or "meta_info" not in data:
            raise Retryable("HTTP 200 without meta_info")
        if data.get("error"):
            raise Retryable(f"error in body: {data['error']}")
        meta = data["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort":
            status = finish.get("status_code")
            msg = f"aborted: {finish.get('message')}"
            if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                raise Fatal(msg)
            raise Retryable(msg)
        output_ids = data.get("output_ids")
        completion = meta.get("completion_tokens")
        if completion is None:
            completion = len(output_ids or [])
        return {
            "response": data.get("text", ""),
            "reasoning": None,
            "output_ids": output_ids,
            "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": completion,
            "finish_reason": kind or "stop",
            "model": self.model,
            "cost": None,
            "meta": meta,
        }

    async def check(self) -> dict:
        """Preflight: the server answers /health and serves a model (named in the result)."""
        url = self.cfg["url"]
        try:
            status, _ = await self.client.get("/health")
            if status != 200:
                raise EagletError(f"{url}: /health answered HTTP {status}")
            status, info = await self.client.get("/get_model_info")
        except httpx.HTTPError as e:
            raise unreachable(url, e) from None
        served = (info or {}).get("model_path") if status == 200 else None
        return {"url": url, "model": served, "model_served": served is not None}

    async def close(self) -> None:
        await self.client.close()
