"""The records every stage passes on: prompts and normalized responses, and their ids (a turn of
a conversation is `<id>/<k>`: `conversation_of`)."""

from __future__ import annotations

import hashlib

from eaglet.formats.io import dumps

ID_LEN = 16
SEP = "/"  # between a conversation's id and a turn's number: `<id>/<k>`
RESPONSE_FIELDS = (
    "id",
    "dataset",
    "messages",
    "response",
    "reasoning",
    "output_ids",
    "prompt_tokens",
    "completion_tokens",
    "server_completion_tokens",
    "finish_reason",
    "backend",
    "model",
    "sampling",
    "cost",
    "latency_s",
    "attempts",
)


def prompt_id(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Content hash of the canonical messages (and tool declarations, when the row has them):
    the same prompt has the same id in every dataset."""
    content: object = {"messages": messages, "tools": tools} if tools else messages
    return hashlib.sha256(dumps(content).encode("utf-8")).hexdigest()[:ID_LEN]


def prompt_record(
    dataset: str, messages: list[dict], line: int, tools: list[dict] | None = None
) -> dict:
    """A prompt, its tool declarations (only when it has some), and the line of the source file
    it came from (the file is keyed by its bytes, not its name, so the name is not recorded)."""
    rec = {"id": prompt_id(messages, tools), "dataset": dataset, "messages": messages}
    if tools:
        rec["tools"] = tools
    return {**rec, "source": {"line": line}}


def response_record(prompt: dict, result: dict, backend: str, sampling: dict) -> dict:
    """One normalized response, whatever the backend; `result` holds what the backend returned."""
    rec = {
        "id": prompt["id"],
        "dataset": prompt["dataset"],
        "messages": prompt["messages"],
        "backend": backend,
        "sampling": sampling,
        "reasoning": None,
        "output_ids": None,
        "server_completion_tokens": None,
        "cost": None,
        "attempts": 1,
    }
    rec.update(result)
    missing = [f for f in RESPONSE_FIELDS if f not in rec]
    if missing:
        raise ValueError(f"response {prompt['id']}: backend result lacks {missing}")
    out = {f: rec[f] for f in RESPONSE_FIELDS}
    if prompt.get("tools"):
        out["tools"] = prompt["tools"]  # the template renders them into the prompt
    if rec.get("tool_calls"):
        out["tool_calls"] = rec["tool_calls"]  # the answer's own calls (API backends)
    return out


def conversation_of(record_id: str) -> str:
    """The conversation a record or sample id belongs to (`<id>/<k>` -> `<id>`)."""
    return record_id.split(SEP, 1)[0]
