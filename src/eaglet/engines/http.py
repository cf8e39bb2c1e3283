"""The one HTTP client and retry policy of the engine layer: every engine spoken to over HTTP
(openai, sglang, vllm), for generation and hidden states alike, posts through `Client`.

One `httpx.AsyncClient` per server, HTTP/1.1 keep-alive, explicit timeouts, at most
`concurrency` connections, no cookies, no proxies from the environment. Its transport spreads
requests over small connection pools: httpcore scans every connection of a pool (with a
socket poll per idle one) for each request, which costs O(connections) per request and capped
one 256-connection pool near 40 req/s on 2 cores; pools of 16 keep that scan short.

Retries: exponential backoff with full jitter on 408/409/425/429/5xx, timeouts, dropped
connections and malformed JSON; `Retry-After` is honoured, and a 429 that carries it pauses
every request of the client, not just the one that got it. A 200 whose body has a shape the
parser does not expect is a failed attempt, retried. 400/401/403/404 are not retried (the
prompt is rejected: recorded with its reason, never sent again);
401 and a 402 for credits stop the whole run; a 402 for the in-flight budget is retried. The
knobs come from the config of the backend (or of `hidden`): `timeout_s`, `concurrency`,
`max_retries`, `backoff_s` and `backoff_max_s` (`hidden` has none of the last two: 0.5 s, 30 s).
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib.util
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from eaglet.errors import EagletError

POOL_CONNECTIONS = 16
RETRY_STATUS = {408, 409, 425, 429}
MAX_RETRY_AFTER_S = 600.0
BACKOFF_S, BACKOFF_MAX_S = 0.5, 30.0  # where the config has no backoff knobs (`hidden`)

# httpcore asks `import sniffio` for every lock it makes; when sniffio is absent each failed
# import rescans sys.path (~90 us, several times per request). Cache the absence once.
if importlib.util.find_spec("sniffio") is None:
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]


class Retryable(Exception):
    """A failure worth another attempt, e.g. 429, 503, a timeout or a cut-off body."""

    def __init__(self, reason: str, retry_after: float | None = None, pause_all: bool = False):
        super().__init__(reason)
        self.retry_after, self.pause_all = retry_after, pause_all


class Fatal(Exception):
    """A failure another attempt would repeat (400, 403, ...): this prompt is rejected."""


class Abort(EagletError):
    """A failure every prompt would share (bad key, no credit): the run stops."""


class _Pools(httpx.AsyncBaseTransport):
    """Several small connection pools behind one transport; each request takes the least busy."""

    def __init__(self, connections: int):
        n = max(1, -(-connections // POOL_CONNECTIONS))
        per = -(-connections // n)
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        self.pools = [httpx.AsyncHTTPTransport(limits=limits, retries=0) for _ in range(n)]
        self.busy = [0] * n

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        i = min(range(len(self.pools)), key=self.busy.__getitem__)
        self.busy[i] += 1
        try:
            response = await self.pools[i].handle_async_request(request)
            await response.aread()  # release the connection before giving the slot back
            return response
        finally:
            self.busy[i] -= 1

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def error_message(body: Any) -> str:
    """The short message of an error body (OpenAI/OpenRouter `error`, SGLang `message`)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or err.get("code")
            meta = err.get("metadata") if isinstance(err.get("metadata"), dict) else {}
            extra = meta.get("reason") or meta.get("error_type")
            return f"{msg} ({extra})" if extra else str(msg)
        if isinstance(err, str):
            return err
    return str(body)[:200]


def classify(status: int, body: Any, headers: httpx.Headers, key_env: str | None = None):
    """Raise the exception an HTTP error status means."""
    msg = f"HTTP {status}: {error_message(body)}"
    wait = retry_after(headers.get("retry-after"))
    if status in RETRY_STATUS or status >= 500:
        raise Retryable(msg, wait, pause_all=status == 429 and wait is not None)
    if status == 402:
        err = body.get("error") if isinstance(body, dict) else None
        meta = err.get("metadata") if isinstance(err, dict) else None
        reason = meta.get("reason") if isinstance(meta, dict) else None
        if reason == "in_flight_budget_exhausted":
            raise Retryable(msg, wait)
        if reason == "weight_exceeds_budget":
            raise Fatal(f"{msg}; lower max_new_tokens")
        raise Abort(f"{msg}; the account is out of credit")
    if status == 401:
        where = f" (check ${key_env})" if key_env else ""
        raise Abort(f"{msg}{where}")
    raise Fatal(msg)


class Client:
    """One server's HTTP client: JSON in, JSON out, retried by the policy above."""

    def __init__(self, base_url: str, cfg: dict, headers: dict | None = None, key_env=None):
        t = cfg["timeout_s"]
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers=headers or {},
            timeout=httpx.Timeout(t, connect=min(t, 30.0), pool=None),
            transport=_Pools(cfg["concurrency"]),
            trust_env=False,
            follow_redirects=False,
        )
        self.max_retries = cfg["max_retries"]
        self.backoff_s = cfg.get("backoff_s", BACKOFF_S)
        self.backoff_max_s = cfg.get("backoff_max_s", BACKOFF_MAX_S)
        self.key_env = key_env
        self._not_before = 0.0  # a 429 with Retry-After holds every request until then

    async def close(self) -> None:
        await self.http.aclose()

    async def get(self, path: str) -> tuple[int, Any]:
        """One GET without retries (preflight): status and the JSON body (or None)."""
        r = await self.http.get(path)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, None

    async def post(self, path: str, body: dict, parse: Callable[[dict], dict]) -> dict:
        """POST `body` until `parse` accepts an answer; return its result with `attempts`, or
        {"error", "attempts"} once the retries are spent or the failure is not retryable."""
        content = json.dumps(body, ensure_ascii=False).encode()
        headers = {"content-type": "application/json"}
        attempt = 0
        while True:
            attempt += 1
            wait = self._not_before - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            t0 = time.monotonic()
            try:
                r = await self.http.post(path, content=content, headers=headers)
                try:
                    data = json.loads(r.content)
                except ValueError:
                    if r.status_code == 200:
                        raise Retryable("HTTP 200 with malformed JSON") from None
                    data = r.text[:200]
                if r.status_code != 200:
                    classify(r.status_code, data, r.headers, self.key_env)
                try:
                    result = parse(data)
                except (Retryable, Fatal, Abort):
                    raise
                except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
                    # a 200 of a shape the parser did not expect: a failed attempt, never a
                    # dead worker
                    shape = f"HTTP 200 of an unexpected shape ({type(e).__name__}: {e})"
                    raise Retryable(shape) from None
            except httpx.TimeoutException as e:
                err: Exception = Retryable(f"timeout ({type(e).__name__})")
            except httpx.TransportError as e:
                err = Retryable(f"connection failed ({type(e).__name__})")
            except Retryable as e:
                err = e
            except Fatal as e:  # another attempt would repeat it: this prompt is rejected
                return {"error": str(e), "attempts": attempt, "rejected": True}
            else:
                result["latency_s"] = round(time.monotonic() - t0, 4)
                result["attempts"] = attempt
                return result
            if attempt > self.max_retries:
                return {"error": f"{err} (after {attempt} attempts)", "attempts": attempt}
            delay = err.retry_after if isinstance(err, Retryable) else None
            if delay is None:
                cap = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                delay = random.uniform(0, cap)
            elif isinstance(err, Retryable) and err.pause_all:
                self._not_before = max(self._not_before, time.monotonic() + delay)
            await asyncio.sleep(delay)


def unreachable(url: str, e: Exception) -> EagletError:
    """The preflight error for a server that does not answer."""
    return EagletError(f"{url}: unreachable ({type(e).__name__}: {e})")
