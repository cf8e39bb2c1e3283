"""The target in-process with `transformers`, on CPU or GPU: the embedded default for generation
and hidden states.

Generation: prompts are rendered with the target's chat template, sorted by length, left-padded
into batches and decoded greedily (temperature 0) or by sampling under a fixed seed. Hidden
states: forward hooks on the decoder trunk (`TransformersHidden`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids, stop_ids
from eaglet.model.capture import right_padded, unbatched
from eaglet.model.target import TargetSpec, load_model, load_tokenizer, pick_device

# speculate: eaglet's own speculative decoder (eaglet.model.speculative) runs on this
# in-process target
CAN = frozenset({"generate", "hidden", "speculate"})
States = tuple[torch.Tensor, torch.Tensor]


def generator(
    name: str, cfg: dict, target: TargetSpec, max_length: int, threads: int | None = None
) -> TransformersBackend:
    return TransformersBackend(name, target, cfg, threads=threads)


def hidden_states(h: dict, target: Any, layer_ids: list[int], threads: int | None = None):
    threads = threads or h["threads"]
    return TransformersHidden(target.spec, h["device"], h["compute_dtype"], layer_ids, threads)


class TransformersBackend:
    concurrency = 1  # one batch at a time: the model already uses every core

    def __init__(self, name: str, spec: TargetSpec, cfg: dict, threads: int | None = None):
        self.name, self.spec, self.cfg = name, spec, cfg
        self.batch_size = cfg["batch_size"]
        self.window = 8 * self.batch_size  # sorted by length, then cut into batches
        threads = threads or cfg.get("threads") or 0
        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(cfg["device"])
        self.tokenizer = load_tokenizer(spec)
        self.model = load_model(spec, self.device, cfg["dtype"])
        self.stop = stop_ids(self.tokenizer, self.model)
        self.pad = self.tokenizer.pad_token_id
        if self.pad is None:
            self.pad = self.stop[0]

    def plan(self, requests: list[dict]) -> list[list[dict]]:
        for r in requests:
            r["_ids"] = prompt_ids(self.tokenizer, r["messages"], r.get("tools"), r.get("mode"))
        ordered = sorted(requests, key=lambda r: len(r["_ids"]))
        size = self.batch_size
        return [ordered[i : i + size] for i in range(0, len(ordered), size)]

    async def generate(self, batch: list[dict]) -> list[dict]:
        return await asyncio.to_thread(self._generate, batch)

    async def close(self) -> None:
        return None

    def _generate(self, batch: list[dict]) -> list[dict]:
        sampling = batch[0]["sampling"]
        assert all(r["sampling"] == sampling for r in batch), "one sampling setting per batch"
        width = max(len(r["_ids"]) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding keeps every prompt's end aligned
            n = len(r["_ids"])
            ids[i, width - n :] = torch.tensor(r["_ids"])
            mask[i, width - n :] = 1
        kwargs: dict[str, Any] = {"max_new_tokens": sampling["max_new_tokens"], "do_sample": False}
        if sampling["temperature"] > 0:
            torch.manual_seed(sampling["seed"])
            kwargs.update(
                do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"]
            )
            if sampling["top_k"] > 0:
                kwargs["top_k"] = sampling["top_k"]
        t0 = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                pad_token_id=self.pad,
                eos_token_id=self.stop,
                **kwargs,
            )
        latency = time.monotonic() - t0
        results = []
        for i, r in enumerate(batch):
            new = out[i, width:].tolist()
            end = next((j for j, t in enumerate(new) if t in self.stop), None)
            output_ids = new if end is None else new[: end + 1]  # keep the stop token, as SGLang
            results.append(
                {
                    "response": self.tokenizer.decode(output_ids, skip_special_tokens=True),
                    "output_ids": output_ids,
                    "prompt_tokens": len(r["_ids"]),
                    "completion_tokens": len(output_ids),
                    "finish_reason": "length" if end is None else "stop",
                    "model": self.spec.name,
                    "reasoning": None,
                    "cost": None,
                    "latency_s": round(latency, 4),
                    "attempts": 1,
                    "meta": {"batch": len(batch)},
                }
            )
        return results


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
        self.trunk(input_ids=right_padded(batch).to(self.device), use_cache=False)
        aux = [self._captured.pop(i) for i in self.layer_ids]
        return unbatched(aux, self._captured.pop("last"), batch)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
