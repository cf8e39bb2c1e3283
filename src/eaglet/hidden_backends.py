"""Where hidden states come from: the target in-process (transformers) or an SGLang server.

Both take batches of token-id sequences and return, per sequence, `aux` [T, K, H] (outputs of
the decoder layers `layer_ids`, SGLang convention) and `last` [T, H] (the final state after the
final norm, i.e. the lm_head input), as float32 or the compute dtype, on the CPU.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import torch

from eaglet.errors import EagletError
from eaglet.target import TargetSpec, load_model

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
