"""A hidden-states connector that drops the final layer's slot, as vLLM before PR #46973 did
for DeepSeek-family models (the engine guard's test: a real engine, an old engine's output)."""

from __future__ import annotations

from eaglet.engines.hidden_connector import CPUHiddenStatesConnector


class DropFinalLayer(CPUHiddenStatesConnector):
    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd) -> None:
        tensors = {**tensors, "hidden_states": tensors["hidden_states"][:, :-1].contiguous()}
        CPUHiddenStatesConnector._write_tensors(tensors, event, filename, lock_fd)
