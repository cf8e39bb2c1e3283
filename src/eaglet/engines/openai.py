"""Any OpenAI-compatible chat-completions endpoint, OpenRouter first: generation only.

The bearer key comes from the environment variable named by `api_key_env`, never from params,
and appears in no log, record or error. `usage.cost` is the cost (else `price_per_mtok`, else
none: an unknown price is never $0); `message.reasoning` is kept apart from `content`;
`provider`, `reasoning` and `extra_body` pass through; an `error` inside a 200 body is an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx

from eaglet.engines.http import Client, Retryable, classify, unreachable
from eaglet.errors import EagletError
from eaglet.model.target import TargetSpec, load_tokenizer

CAN = frozenset({"generate"})  # text (and usage) back, never a state of the target


def generator(
    name: str, cfg: dict, target: TargetSpec, max_length: int, threads: int | None = None
) -> OpenAIBackend:
    return OpenAIBackend(name, cfg, lambda: load_tokenizer(target))


class OpenAIBackend:
    batch_size = window = 1

    def __init__(self, name: str, cfg: dict, tokenizer: Callable[[], Any]):
        self.name, self.cfg = name, cfg
        self.concurrency = cfg["concurrency"]
        self.model = cfg["model"]
        key = os.environ.get(cfg["api_key_env"])
        if not key:
            raise EagletError(
                f"backends.{name}: environment variable {cfg['api_key_env']} (api_key_env) "
                "is not set"
            )
        headers = {"authorization": f"Bearer {key}", "x-title": "eaglet"}
        self.client = Client(cfg["base_url"], cfg, headers, key_env=cfg["api_key_env"])
        self._tokenizer_factory, self._tokenizer = tokenizer, None
        self.price = cfg.get("price_per_mtok")

    def plan(self, requests: list[dict]) -> list[list[dict]]:
        return [[r] for r in requests]

    async def generate(self, batch: list[dict]) -> list[dict]:
        (request,) = batch
        body = chat_body(request, self.model, self.cfg)
        return [await self.client.post("chat/completions", body, self.parse)]

    def parse(self, data: Any) -> dict:
        return parse_chat(data, self.model, self.count, self.price)

    def count(self, text: str) -> int:
        """No usage in the answer: count with the target tokenizer."""
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    async def check(self) -> dict:
        """Preflight: reachable, model served, key valid, credit left (OpenRouter `/key`)."""
        base = self.cfg["base_url"]
        out: dict[str, Any] = {"url": base, "model": self.model}
        try:
            status, models = await self.client.get("models")
        except httpx.HTTPError as e:
            raise unreachable(base, e) from None
        if status == 401:
            raise EagletError(f"{base}: key rejected (HTTP 401; check ${self.cfg['api_key_env']})")
        ids = {m.get("id"): m for m in (models or {}).get("data", []) if isinstance(m, dict)}
        out["model_served"] = self.model in ids if ids else None
        if ids and self.model not in ids:
            raise EagletError(f"{base}: model '{self.model}' is not served")
        pricing = ids.get(self.model, {}).get("pricing") or {}
        if self.price:
            out["price_per_token"] = {k: v / 1e6 for k, v in self.price.items()}
        elif pricing:
            out["price_per_token"] = {k: float(pricing[k]) for k in ("prompt", "completion")}
        status, key = await self.client.get("key")
        if status == 401:
            raise EagletError(f"{base}: key rejected (HTTP 401; check ${self.cfg['api_key_env']})")
        if status == 200 and isinstance(key, dict):
            data = key.get("data", {})
            out["key"] = "valid"
            out["credit"] = {"limit": data.get("limit"), "remaining": data.get("limit_remaining")}
        else:
            out["key"] = "not checked (no /key route)"
        return out

    async def close(self) -> None:
        await self.client.close()


def chat_body(request: dict, model: str, cfg: dict) -> dict:
    """The chat-completions request: messages, token cap, sampling, passthrough options."""
    s = request["sampling"]
    field = cfg.get("reasoning_field", "reasoning_content")
    body: dict[str, Any] = {
        "model": model,
        "messages": [_sent(m, field) for m in request["messages"]],
        "max_tokens": s["max_new_tokens"],
        "temperature": s["temperature"],
        "top_p": s["top_p"],
        "seed": s["seed"],
    }
    if s["top_k"] > 0:
        body["top_k"] = s["top_k"]
    if request.get("tools"):
        body["tools"] = request["tools"]
    for k in ("provider", "reasoning"):
        if k in cfg:
            body[k] = cfg[k]
    body.update(cfg.get("extra_body", {}))
    if request.get("mode"):  # thinking on or off, as this server takes the switch
        body.update(thinking_switch(request["mode"], cfg.get("thinking_via"), body))
    return body


def thinking_switch(mode: dict, via: str | None, body: dict) -> dict:
    """The request fields that ask for `mode` (`{"thinking": False}`, the template's argument):
    the template argument itself for vLLM and SGLang servers, OpenRouter's `reasoning.enabled`,
    Moonshot's `thinking.type`."""
    [on] = mode.values()
    if via == "openrouter":
        return {"reasoning": {**body.get("reasoning", {}), "enabled": on}}
    if via == "moonshot":
        return {"thinking": {"type": "enabled" if on else "disabled"}}
    return {"chat_template_kwargs": {**body.get("chat_template_kwargs", {}), **mode}}


def _sent(message: dict, field: str) -> dict:
    """A message as the provider reads it: an assistant turn's reasoning in `field`."""
    if field == "reasoning_content" or "reasoning_content" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    return out | {field: message["reasoning_content"]}


def parse_chat(
    data: Any, model: str, count: Callable[[str], int], price: dict | None = None
) -> dict:
    """One chat completion -> a result; errors in the body raise like HTTP errors."""
    if not isinstance(data, dict):
        raise Retryable("HTTP 200 with a body that is not a JSON object")
    if data.get("error"):
        _body_error(data)
    choices = data.get("choices")
    if not choices or not isinstance(choices[0], dict):
        raise Retryable("HTTP 200 without choices")
    choice = choices[0]
    if choice.get("error"):
        _body_error(choice)
    if choice.get("finish_reason") == "error":
        raise Retryable("finish_reason error")
    message = choice.get("message") or {}
    if not isinstance(message, dict):
        raise Retryable("HTTP 200 whose message is not an object")
    text = message.get("content") or ""
    if not isinstance(text, str):
        raise Retryable("HTTP 200 whose message content is not text")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    calls = message.get("tool_calls") or None
    if calls is not None and not all(
        isinstance(c, dict) and isinstance((c.get("function") or {}).get("name"), str)
        for c in calls
    ):
        raise Retryable("HTTP 200 with a malformed tool call")
    usage = data.get("usage") or {}
    output_ids = choice.get("response_token_ids")  # SGLang >= 0.5.23 returns them on request
    server = usage.get("completion_tokens")  # counts reasoning; kept beside for the drift check
    completion = len(output_ids) if output_ids else server
    if completion is None:
        completion = count((reasoning or "") + text)
    prompt = usage.get("prompt_tokens")
    cost = usage.get("cost")
    if cost is None and price and prompt is not None:
        cost = (prompt * price.get("prompt", 0) + completion * price.get("completion", 0)) / 1e6
    meta = {k: data[k] for k in ("id", "provider") if k in data}
    if usage:
        meta["usage"] = usage
    result = {
        "response": text,
        "reasoning": reasoning,
        "output_ids": output_ids,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "server_completion_tokens": server,
        "finish_reason": choice.get("finish_reason") or "stop",
        "model": data.get("model") or model,
        "cost": cost,
        "meta": meta,
    }
    return result | ({"tool_calls": calls} if calls else {})


def _body_error(data: dict) -> None:
    """An `error` inside a 200 body: classified by its own code (retried when unknown)."""
    err = data["error"]
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    classify(status, data, httpx.Headers())
