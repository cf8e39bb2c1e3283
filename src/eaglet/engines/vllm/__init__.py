"""vLLM: generation, hidden states and speculative decoding, from a server eaglet starts and
always stops, or one an operator runs.

- `config`: how a target is served (`ServeConfig`: the server's command line and environment);
- `server`: the server's process, started, watched and always stopped, or reached by URL
  (`Engine`), and its `GET /metrics` text;
- `generate`: the generation client (`VLLMBackend`, `POST /v1/completions` in token ids);
- `hidden`: hidden states through the `extract_hidden_states` method (`VLLMHidden`).

This module is the engine's face to eaglet.engines.lookup: what it can do (`CAN`) and a factory
per job. Callers of the server (the engine evaluation, tests, benchmarks) import `config` and
`server` themselves.
"""

from __future__ import annotations

from typing import Any

from eaglet.device import resolve_dtype
from eaglet.engines.vllm.generate import VLLMBackend
from eaglet.engines.vllm.hidden import VLLMHidden
from eaglet.model.target import TargetSpec, load_tokenizer

CAN = frozenset({"generate", "hidden", "speculate"})


def generator(
    name: str, cfg: dict, target: TargetSpec, max_length: int, threads: int | None = None
) -> VLLMBackend:
    backend = VLLMBackend(name, cfg, target, load_tokenizer(target), max_length, threads)
    backend.start()  # here, in the main thread: the server's parent-death signal needs it
    return backend


def hidden_states(h: dict, target: Any, layer_ids: list[int], threads: int | None = None):
    threads = threads or h["threads"]
    dtype = resolve_dtype(h["compute_dtype"], h["device"])
    n_layers = target.config.num_hidden_layers
    return VLLMHidden(target.spec, h, layer_ids, n_layers, dtype, target.max_length, threads)
