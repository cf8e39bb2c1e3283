"""Which assistant turns of a conversation the target regenerates, and what each is asked with.

`turns: all` (the default): every assistant turn. A conversation without tool results is
replayed: turn k is asked with the dataset's user turns and the target's own answers to turns
1..k-1, read from the response store (so a rerun asks exactly the same). A trajectory with tool
results cannot be replayed, since the tools answered the recorded calls and not the target's:
each of its turns is asked with the recorded trajectory before it. `turns: last`: only the turn
after the recorded conversation, as the dataset wrote its history.

A replayed conversation ends at its first turn that cannot go on: not answered yet, failed,
refused, too long, or cut at max_new_tokens under `truncated: drop`. The turns before it stay.

A turn's record id is the conversation's id when the conversation has one turn, else `<id>/<k>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eaglet.formats.records import SEP


@dataclass(frozen=True)
class Turn:
    """One assistant turn to regenerate: the conversation's prompt record, the turn's number
    (1-based) of `n`, the messages it is asked with, and its request key in the store."""

    prompt: dict
    k: int
    n: int
    messages: list[dict]
    key: str
    replay: bool  # asked after the target's own earlier answers (no tool results)

    @property
    def id(self) -> str:
        return self.prompt["id"] if self.n == 1 else f"{self.prompt['id']}{SEP}{self.k}"


def cuts(messages: list[dict], turns: str) -> list[int]:
    """Where each regenerated turn's request ends: before every assistant message that answers
    a user or a tool (`all`), and at the end of the prompt, the turn the dataset's answer was
    cut from."""
    if turns != "all":
        return [len(messages)]
    ends = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and i and messages[i - 1]["role"] in ("user", "tool")
    ]
    return [*ends, len(messages)]


def replayed(messages: list[dict]) -> bool:
    """Whether the target's own answers can stand in for the recorded ones: no tool results."""
    return not any(m["role"] == "tool" for m in messages)


def answer_message(result: dict) -> dict:
    """A stored answer as the assistant message of the next turn's history (reasoning under
    `reasoning_content`, as the templates and chat servers read it)."""
    msg: dict = {"role": "assistant", "content": result.get("response") or ""}
    if result.get("reasoning"):
        msg["reasoning_content"] = result["reasoning"]
    if result.get("tool_calls"):
        msg["tool_calls"] = result["tool_calls"]
    return msg


def goes_on(row: dict | None, truncated: str) -> bool:
    """Whether a replayed conversation goes on after a turn with this stored row."""
    if row is None or row["status"] != "ok":
        return False
    return truncated == "keep" or row["result"]["finish_reason"] != "length"


class Conversations:
    """The turns of a chunk of conversations, each as far as the store lets it be asked: all
    turns of a recorded trajectory at once, a replayed conversation's turn k once turn k-1 is
    answered. `lookup` reads stored rows by key (None where there is none)."""

    def __init__(
        self,
        turns: str,
        truncated: str,
        keyfn: Callable[[dict, list[dict]], str],
        lookup: Callable[[list[str]], dict[str, dict]],
    ):
        self.turns, self.truncated, self.keyfn, self.lookup = turns, truncated, keyfn, lookup

    def walk(self, prompts: list[dict]) -> list[list[tuple[Turn, dict | None]]]:
        """Per prompt, its askable turns in order with their stored rows."""
        out: list[list[tuple[Turn, dict | None]]] = [[] for _ in prompts]
        plans = [cuts(p["messages"], self.turns) for p in prompts]
        replay = [replayed(p["messages"]) for p in prompts]
        todo = list(range(len(prompts)))
        while todo:
            asked: list[tuple[int, Turn]] = []
            for i in todo:
                p, ends = prompts[i], plans[i]
                ks = [len(out[i]) + 1] if replay[i] else range(1, len(ends) + 1)
                for k in ks:
                    msgs = self.history(p["messages"], ends, k, out[i] if replay[i] else None)
                    turn = Turn(p, k, len(ends), msgs, self.keyfn(p, msgs), replay[i])
                    asked.append((i, turn))
            rows = self.lookup([t.key for _, t in asked])
            for i, t in asked:
                out[i].append((t, rows.get(t.key)))
            todo = [
                i
                for i in dict.fromkeys(i for i, _ in asked)
                if replay[i]
                and len(out[i]) < len(plans[i])
                and goes_on(out[i][-1][1], self.truncated)
            ]
        return out

    @staticmethod
    def history(messages: list[dict], ends: list[int], k: int, answered: list | None) -> list[dict]:
        """Turn k's request: the messages before it, the recorded assistant turns replaced by
        the target's answers where the conversation is replayed (`answered`: its turns so far)."""
        msgs = messages[: ends[k - 1]]
        if answered is None or k == 1:
            return msgs
        own = iter(answer_message(row["result"]) for _, row in answered[: k - 1])
        return [next(own) if i in ends[: k - 1] else m for i, m in enumerate(msgs)]
