"""SGLang servers: generation (native `POST /generate`, or its OpenAI-compatible chat route) and
hidden states (two servers, `SGLangHidden`), both through the engine layer's one HTTP client.

`/generate` gets the prompt as `input_ids`, rendered by the target's own chat template here (so
the server's template can never drift from the one the drafter is trained with), and
`sampling_params` with `max_new_tokens` always set (SGLang's default is 128). Its `output_ids` and
`meta_info` are kept; `finish_reason` comes back as an object and is normalised to its `type`.
`endpoint: chat` sends the messages to `/v1/chat/completions` and parses like the openai backend.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx

from eaglet.engines.http import Client, Fatal, Retryable, unreachable
from eaglet.engines.openai import chat_body, parse_chat
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.model.target import TargetSpec, load_tokenizer

if TYPE_CHECKING:
    import torch

    States = tuple[torch.Tensor, torch.Tensor]

# eaglet speculates with transformers (eaglet.model.speculative) and vLLM (the engine
# evaluation), not with SGLang: its export is written and validated, never served here
CAN = frozenset({"generate", "hidden"})


def generator(
    name: str, cfg: dict, target: TargetSpec, max_length: int, threads: int | None = None
) -> SGLangBackend:
    return SGLangBackend(name, cfg, load_tokenizer(target), target.name)


def hidden_states(h: dict, target: Any, layer_ids: list[int], threads: int | None = None):
    return SGLangHidden(h, target.config.hidden_size, len(layer_ids))


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
        ids = prompt_ids(
            self.tokenizer, request["messages"], request.get("tools"), request.get("mode")
        )
        return {"input_ids": ids, "sampling_params": sp}

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
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
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
        server = meta.get("completion_tokens")  # kept beside: the drift check compares them
        completion = len(output_ids) if isinstance(output_ids, list) else server
        return {
            "response": data.get("text", ""),
            "reasoning": None,
            "output_ids": output_ids,
            "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": completion,
            "server_completion_tokens": server,
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


class SGLangHidden:
    """Two SGLang `/generate` servers of the target, prefilling each sequence once.

    `url` runs with `--enable-return-aux-hidden-states` (EAGLE-3 capture: the K aux states,
    concatenated to [T, K*H]) and `last_url` with `--enable-return-hidden-states` (the state fed
    to lm_head, [T, H]); SGLang returns one or the other per server. Both need
    `--disable-radix-cache`, so a cached prefix never shortens the returned prefill states.
    One `Client` per server (`hidden.timeout_s`, `hidden.max_retries`), `concurrency` batches
    in flight.
    """

    def __init__(self, cfg: dict, hidden_size: int, n_aux: int):
        import torch

        self.cfg = cfg
        self.url, self.last_url = cfg["url"].rstrip("/"), cfg["last_url"].rstrip("/")
        self.hidden_size, self.n_aux = hidden_size, n_aux
        self.dtype = torch.float32

    def run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        return asyncio.run(self._run(batches))

    def close(self) -> None:
        return None

    async def _run(self, batches: list[list[list[int]]]) -> list[list[States]]:
        limit = asyncio.Semaphore(self.cfg["concurrency"])
        aux_client, last_client = Client(self.url, self.cfg), Client(self.last_url, self.cfg)

        async def one(batch: list[list[int]]) -> list[States]:
            async with limit:
                aux = await self._prefill(aux_client, self.url, batch, self.n_aux)
                last = await self._prefill(last_client, self.last_url, batch, 1)
            pairs = zip(aux, last, strict=True)
            return [(a.reshape(len(a), self.n_aux, -1), b) for a, b in pairs]

        try:
            return await asyncio.gather(*(one(b) for b in batches))
        finally:
            await aux_client.close()
            await last_client.close()

    async def _prefill(
        self, client: Client, url: str, batch: list[list[int]], n_states: int
    ) -> list[torch.Tensor]:
        import torch

        body = {
            "input_ids": batch,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
        }
        answer = await client.post("/generate", body, lambda data: {"answers": data})
        if "error" in answer:
            raise EagletError(f"{url}/generate: {answer['error']}")
        answers = answer["answers"]
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
