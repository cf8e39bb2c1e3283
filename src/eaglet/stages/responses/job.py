"""One dataset's generation, resolved (Job): what to ask, whom, the budgets that stop it, and
where things are. The stage's run builds it; its kernel and the preflight read it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglet.engines.lookup import Backend, generator
from eaglet.formats.io import read_json, read_jsonl
from eaglet.formats.store import RequestKeys, Store, charged
from eaglet.graph.keys import sidecar_of
from eaglet.model.target import TargetSpec
from eaglet.stages.responses.spec import sample_mode
from eaglet.stages.responses.turns import Conversations, Turn

CHUNK = 512  # prompts read and looked up at a time


@dataclass(frozen=True)
class Job:
    """One dataset's generation, resolved: what to ask, whom, the budgets that stop it (from the
    stage's spec), and where things are (beside it)."""

    dataset: str
    backend: str  # its name in params: `backends.<name>`
    kind: str
    engine: dict  # its settings (the spec holds its identity)
    target: TargetSpec  # where the target's files are
    max_length: int  # target.max_length: a served engine's context
    prompt_limit: int  # the dataset's max_length: a longer prompt leaves no answer to train on
    sampling: dict
    keyfn: RequestKeys
    prompts: Path
    store: Path
    out: Path
    token_budget: int | None
    max_cost_usd: float | None
    overall: dict
    response_key: str
    grammar: str  # the target's output grammar: text answers -> its tokens
    max_token_drift: float
    mode: dict | None = None  # the spec's thinking mode (sample_mode gives each prompt's)
    truncated: str = "drop"  # drop or keep the answers cut at max_new_tokens
    marker_text: str = "skip"  # skip or keep the text answers holding a marker's text
    turns: str = "all"  # the assistant turns regenerated: all, or the last
    threads: int | None = None
    quiet: bool = False
    params_name: str | None = None  # the params file's name: whose spend the answers are

    @property
    def caps(self) -> dict:
        """The project budget's caps (`budget.token_budget`, `budget.max_cost_usd`) that apply."""
        return {k: self.overall[k] for k in ("token_budget", "max_cost_usd") if k in self.overall}

    @property
    def spend_count(self) -> str:
        """What the project budget charges (`budget.count`): `this_run` or `store`."""
        return self.overall.get("count", "this_run")

    def spend(self, store: Store) -> tuple[int, float]:
        """Completion tokens and dollars charged to the project budget now."""
        return charged(store.spend(self.params_name), self.spend_count)

    def mode_of(self, prompt: dict) -> dict | None:
        """The template arguments `prompt` is answered with, or None (the template's default)."""
        return sample_mode(self.mode, prompt["id"])

    def key(self, prompt: dict) -> str:
        """The request key of the turn after the prompt's recorded conversation (`turns: last`):
        its messages in its mode."""
        return self.keyfn(prompt["messages"], self.mode_of(prompt))

    def conversations(self, store: Store) -> Iterator[list[list[tuple[Turn, dict | None]]]]:
        """Conversations in prompt order, CHUNK at a time: each its turns as far as the store
        lets them be asked (eaglet.stages.responses.turns), with their stored rows (None: not
        stored)."""
        convs = Conversations(
            self.turns,
            self.truncated,
            lambda p, messages: self.keyfn(messages, self.mode_of(p)),
            store.get_many,
        )
        it = read_jsonl(self.prompts)
        while chunk := list(itertools.islice(it, CHUNK)):
            yield convs.walk(chunk)

    def count(self) -> int:
        side = sidecar_of(self.prompts)
        if side.exists():
            return read_json(side)["stats"]["kept"]
        return sum(1 for _ in read_jsonl(self.prompts))

    def generator(self, threads: int | None = None) -> Backend:
        """The backend, ready to answer."""
        return generator(
            self.kind, self.backend, self.engine, self.target, self.max_length, threads
        )
