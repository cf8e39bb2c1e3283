"""A loopback LLM server for tests and benchmarks, speaking SGLang and OpenAI over real HTTP/1.1.

Routes: SGLang `POST /generate`, `GET /health`, `GET /get_model_info`; OpenAI/OpenRouter
`POST /v1/chat/completions` (also SGLang's chat route), `GET /v1/models`, `GET /v1/key`.

Answers are a pure function of the request content (the messages or `input_ids`, and the token
cap), so a test can recompute exactly what the server sent. Faults are drawn per (request content,
attempt number) from a seeded RNG, so they do not depend on timing; at most `max_faults` attempts
of one request fail, after which it is answered. Fault kinds:
    429       rate limited, with `Retry-After: <retry_after>`
    500, 503  server errors
    402       in-flight budget exhausted (transient, with Retry-After)
    400       a bad request (not worth retrying)
    truncated a 200 whose JSON body is cut in half
    drop      the connection is closed without an answer
    error200  a 200 whose body carries `error` (OpenRouter style)
    badshape  a 200 of an unexpected shape (a chat `message` that is a string, `meta_info: null`)
    slow      the answer comes `slow_s` late (past a short client timeout)

Run standalone (benchmarks): `python -m tests.fake_llm --latency 0.5` prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import threading
import time
from collections import Counter, defaultdict

EOS = 2
PRICE_PROMPT = 1e-7  # $ per prompt token
PRICE_COMPLETION = 2e-6  # $ per completion token
MODEL = "fake/model-1"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def chat_digest(messages: list[dict], max_tokens: int) -> str:
    """The key under which the server logs a chat request's attempts and answers."""
    return _digest([messages, max_tokens])


def answer_tokens(content, cap: int, spread: int = 24) -> list[int]:
    """The completion token ids for a request: 1..spread ids, ending in EOS unless capped."""
    h = int(_digest(content)[:12], 16)
    n = 1 + h % spread
    ids = [100 + (h >> (i % 40)) % 5000 for i in range(n - 1)] + [EOS]
    return ids[:cap]


# Words that are one token each in SmolLM2's vocabulary, alone or after a space: an answer of
# n words is n tokens (+ <|im_end|>), so usage counts what the served model emitted, as a real
# server's does (tests check it against the target's own tokenizer).
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "have",
    "an",
    "are",
    "not",
    "but",
    "had",
    "his",
    "they",
    "you",
    "which",
    "one",
    "were",
    "all",
    "we",
    "her",
    "she",
    "there",
    "can",
    "been",
    "has",
    "more",
    "if",
    "will",
    "would",
    "who",
    "so",
    "what",
    "their",
    "no",
    "out",
    "up",
    "said",
    "about",
    "into",
    "when",
    "them",
    "some",
    "could",
    "him",
    "time",
    "only",
]


def openai_answer(messages: list[dict], max_tokens: int) -> dict:
    """What the server answers to a chat request: text, reasoning, tokens, cost, finish."""
    ids = answer_tokens(messages, max_tokens)
    text = " ".join(WORDS[i % len(WORDS)] for i in ids if i != EOS)
    prompt_tokens = len(json.dumps(messages)) // 4
    finish = "stop" if ids[-1] == EOS else "length"
    completion = len(ids)
    cost = round(prompt_tokens * PRICE_PROMPT + completion * PRICE_COMPLETION, 10)
    return {
        "text": text,
        "reasoning": f"thinking about {len(messages)} messages",
        "completion_tokens": completion,
        "prompt_tokens": prompt_tokens,
        "finish_reason": finish,
        "cost": cost,
    }


def sglang_answer(input_ids: list[int], max_new_tokens: int) -> dict:
    ids = answer_tokens(input_ids, max_new_tokens)
    finish = {"type": "stop", "matched": EOS} if ids[-1] == EOS else {"type": "length"}
    if finish["type"] == "length":
        finish["length"] = len(ids)
    return {
        "text": " ".join(f"t{i}" for i in ids if i != EOS),
        "output_ids": ids,
        "meta_info": {
            "id": _digest(input_ids)[:32],
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        },
    }


class FakeLLM:
    """The server; `start()` runs it on a loopback port in a daemon thread."""

    def __init__(
        self,
        *,
        latency: float = 0.0,
        faults: dict[str, float] | None = None,
        seed: int = 0,
        max_faults: int = 3,
        retry_after: str = "0",
        slow_s: float = 2.0,
        api_key: str | None = None,
        credit: float | None = 10.0,
        model: str = MODEL,
    ):
        self.latency, self.faults, self.seed = latency, faults or {}, seed
        self.max_faults, self.retry_after, self.slow_s = max_faults, retry_after, slow_s
        self.api_key, self.credit, self.model = api_key, credit, model
        self.attempts: Counter = Counter()  # request content digest -> attempts seen
        self.sent: dict[str, list[dict]] = defaultdict(list)  # digest -> full answers sent
        self.faulted: Counter = Counter()  # fault kind -> times injected
        self.requests = 0
        self.bodies: list[dict] = []  # every POST body received (keep_bodies only)
        self.keep_bodies = False
        self.times: dict[str, list[float]] = defaultdict(list)  # digest -> arrival times
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ protocol
    def _fault(self, digest: str, attempt: int) -> str | None:
        if not self.faults or attempt > self.max_faults:
            return None
        r = random.Random(f"{self.seed}:{digest}:{attempt}").random()
        for kind, rate in self.faults.items():
            if r < rate:
                return kind
            r -= rate
        return None

    def _route(self, method: str, path: str, headers: dict, body: bytes):
        """(status or connection fault, headers, payload, digest of an answer to record)."""
        authorized = headers.get("authorization") == f"Bearer {self.api_key}"
        guarded = path.startswith("/v1/") and path != "/v1/models"
        if self.api_key is not None and not authorized and guarded:
            return 401, {}, {"error": {"code": 401, "message": "No auth credentials"}}, None
        if method == "GET":
            return (*self._get(path), None)
        try:
            req = json.loads(body)
        except ValueError:
            return 400, {}, {"error": {"code": 400, "message": "invalid JSON body"}}, None
        if self.keep_bodies:
            self.bodies.append(req)
        if path == "/generate":
            sp = req.get("sampling_params", {})
            if "max_new_tokens" not in sp or not isinstance(req.get("input_ids"), list):
                return 400, {}, {"error": {"message": "need input_ids and max_new_tokens"}}, None
            content, make = [req["input_ids"], sp["max_new_tokens"]], self._generate
        elif path in ("/v1/chat/completions", "/chat/completions"):
            if "messages" not in req or "max_tokens" not in req:
                err = {"code": 400, "message": "need messages, max_tokens"}
                return 400, {}, {"error": err}, None
            content, make = [req["messages"], req["max_tokens"]], self._chat
        else:
            return 404, {}, {"error": {"code": 404, "message": f"no route {path}"}}, None
        digest = _digest(content)
        self.attempts[digest] += 1
        self.times[digest].append(time.monotonic())
        fault = self._fault(digest, self.attempts[digest])
        if fault:
            self.faulted[fault] += 1
        wait = {"Retry-After": self.retry_after}
        if fault in ("truncated", "drop"):
            return fault, {}, make(req), None
        if fault == "slow":
            return fault, {}, make(req), digest
        if fault == "429":
            return 429, wait, {"error": {"code": 429, "message": "Rate limit exceeded"}}, None
        if fault == "402":
            meta = {"reason": "in_flight_budget_exhausted"}
            return 402, wait, {"error": {"code": 402, "message": "budget", "metadata": meta}}, None
        if fault == "400":
            return 400, {}, {"error": {"code": 400, "message": "bad request"}}, None
        if fault in ("500", "503"):
            err = {"code": int(fault), "message": "upstream error"}
            return int(fault), {}, {"error": err}, None
        if fault == "error200":
            return 200, {}, {"error": {"code": 502, "message": "provider returned error"}}, None
        if fault == "badshape":  # a 200 of a shape no client expects
            bad = make(req)
            if "meta_info" in bad:
                bad["meta_info"] = None
            else:
                bad["choices"][0]["message"] = "not an object"
            return 200, {}, bad, None
        return 200, {}, make(req), digest

    def _get(self, path: str) -> tuple[int, dict, dict]:
        if path == "/health":
            return 200, {}, {}
        if path == "/get_model_info":
            return 200, {}, {"model_path": self.model, "is_generation": True}
        if path == "/v1/models":
            pricing = {"prompt": str(PRICE_PROMPT), "completion": str(PRICE_COMPLETION)}
            return 200, {}, {"data": [{"id": self.model, "pricing": pricing}]}
        if path == "/v1/key":
            return 200, {}, {"data": {"limit": self.credit, "limit_remaining": self.credit}}
        return 404, {}, {"error": {"code": 404, "message": f"no route {path}"}}

    def _chat(self, req: dict) -> dict:
        a = openai_answer(req["messages"], req["max_tokens"])
        provider = (req.get("provider") or {}).get("order", ["fakeprov"])[0]
        message = {"role": "assistant", "content": a["text"]}
        switch = req.get("reasoning") or {}
        if switch and switch.get("effort") != "none" and switch.get("enabled", True):
            message["reasoning"] = a["reasoning"]
        return {
            "id": "gen-" + _digest(req["messages"])[:16],
            "model": req.get("model"),
            "provider": provider,
            "choices": [{"index": 0, "message": message, "finish_reason": a["finish_reason"]}],
            "usage": {
                "prompt_tokens": a["prompt_tokens"],
                "completion_tokens": a["completion_tokens"],
                "total_tokens": a["prompt_tokens"] + a["completion_tokens"],
                "cost": a["cost"],
            },
        }

    def _generate(self, req: dict) -> dict:
        return sglang_answer(req["input_ids"], req["sampling_params"]["max_new_tokens"])

    # ------------------------------------------------------------------ HTTP/1.1
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests += 1
                route = self._route(method, path.split("?")[0], headers, body)
                status, extra, payload, digest = route
                if self.latency:
                    await asyncio.sleep(self.latency)
                if status == "drop":
                    break
                if status == "slow":
                    await asyncio.sleep(self.slow_s)
                    status = 200
                data = json.dumps(payload).encode()
                if status == "truncated":
                    status, data = 200, data[: len(data) // 2]
                hdrs = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                writer.write(
                    f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n{hdrs}\r\n".encode()
                    + data
                )
                await writer.drain()
                if digest is not None:  # a full answer went out
                    self.sent[digest].append(payload)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _serve(self, port: int, ready: threading.Event | None):
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", port, backlog=4096)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        if ready is not None:
            ready.set()
        await self._stopping.wait()
        server.close()  # open connections end with the loop

    def start(self, port: int = 0) -> FakeLLM:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(port, ready),), daemon=True
        )
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        """Stop listening (idempotent); returns once the port is closed."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description="loopback fake LLM server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--api-key")
    args = ap.parse_args()
    fake = FakeLLM(latency=args.latency, api_key=args.api_key)

    async def run():
        task = asyncio.create_task(fake._serve(args.port, None))
        while not fake.url:
            await asyncio.sleep(0.01)
        print(fake.url, flush=True)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
