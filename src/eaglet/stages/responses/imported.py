"""Responses made outside eaglet (a `raw_responses.jsonl`) -> the response store.

`eaglet import-responses DATASET FILE` files each answer under the request key the dataset's
current backend and sampling would use, so `eaglet status` counts it and `eaglet generate` pays
only for what the file lacks. Importing asserts that the file was made with those settings.
One line per answer, in either schema the old scripts wrote (or eaglet's own records):

    OpenAI style: {"messages": [...], "response": "...", "finish_reason": "stop",
                   "usage": {"prompt_tokens": 50, "completion_tokens": 212, "cost": 0.0004}}
    SGLang style: {"conversations": [...], "text": "...", "output_ids": [...],
                   "meta_info": {"prompt_tokens": 50, "completion_tokens": 212,
                                 "finish_reason": {"type": "stop"}}}

The prompt is `prompt` (messages), or `messages` / `conversations` (ShareGPT) cut before their
final assistant turn, or, by `id`, a prompt of the dataset. The answer is `response`, `text`,
`content`, `output` or `choices[0].message.content`, else that final assistant turn; its
reasoning `reasoning` / `reasoning_content` (top level or in `choices[0].message`), its tool
calls `tool_calls` (likewise), and `output_ids` when the engine returned them. Generated tokens:
the length of `output_ids`, else the file's count (`completion_tokens`, `usage.
completion_tokens`, `meta_info.completion_tokens`), else counted with the target tokenizer; the
file's count is kept beside, and the summary gives the drift between the two (the responses
stage stops past `generation.max_token_drift`). The summary's tokens, cost and drift count only
the answers new to the store; an answer that cannot be written as the target's stream (its text
holds a marker) is stored and counted as `unwritable`: the responses stage leaves it out.

Imported answers are stored as such (`origin: imported`): the project budget does not charge
them to a run (`budget.count: this_run`), and the dry run and the sidecars report them beside.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.datasets import BadRow, prompt_of, to_messages, tool_call
from eaglet.formats.grammar import grammar, rename_calls
from eaglet.formats.io import dumps, read_jsonl
from eaglet.formats.readers import iter_rows
from eaglet.formats.records import response_record
from eaglet.formats.store import Origin, Store
from eaglet.graph.keys import resolve_stage
from eaglet.params import Params
from eaglet.stages.responses.kernel import Streams

ANSWER_KEYS = ("response", "text", "content", "output")


def _conversation(row: dict) -> list[dict] | None:
    for key in ("prompt", "messages", "conversations"):
        if isinstance(row.get(key), list):
            return to_messages({key if key != "prompt" else "messages": row[key]}, "auto")
    return None


def _message(row: dict) -> dict:
    """`choices[0].message` of an OpenAI-style row, or {}."""
    choices = row.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else {}
    return {}


def _answer(row: dict) -> str | None:
    for key in ANSWER_KEYS:
        if isinstance(row.get(key), str):
            return row[key]
    content = _message(row).get("content")
    if isinstance(content, str):
        return content
    if content is None and _message(row).get("tool_calls"):
        return ""
    return None


def _reasoning(row: dict) -> str | None:
    for where in (row, _message(row)):
        for key in ("reasoning_content", "reasoning"):
            value = where.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise BadRow(f"{key}: expected a string")
                return value or None
    return None


def _calls(row: dict) -> list[dict] | None:
    calls = row.get("tool_calls") or _message(row).get("tool_calls")
    if not calls:
        return None
    if not isinstance(calls, list):
        raise BadRow("tool_calls: expected a list")
    return [tool_call(call, f"tool_calls[{k}]", f"call_{k}") for k, call in enumerate(calls)]


def _finish(row: dict) -> str:
    meta = row.get("meta_info") if isinstance(row.get("meta_info"), dict) else {}
    choices = row.get("choices") if isinstance(row.get("choices"), list) else [{}]
    value = row.get("finish_reason") or meta.get("finish_reason") or choices[0].get("finish_reason")
    if isinstance(value, dict):
        value = value.get("type")
    return str(value) if value else "stop"


def _output_ids(row: dict) -> list[int] | None:
    output_ids = row.get("output_ids")
    if output_ids is not None and not (
        isinstance(output_ids, list) and all(isinstance(i, int) for i in output_ids)
    ):
        raise BadRow("output_ids: expected a list of integers")
    return output_ids


def _server_tokens(row: dict, usage: dict, meta: dict) -> int | None:
    """The file's own count of the generated tokens, if it gives one."""
    counts = (
        row.get("completion_tokens"),
        usage.get("completion_tokens"),
        meta.get("completion_tokens"),
    )
    server = next((v for v in counts if v is not None), None)
    if server is not None and (not isinstance(server, int) or server < 0):
        raise BadRow(f"completion_tokens: expected a count, got {server!r}")
    return server


def normalize(row: dict, prompts: dict[str, list], count) -> tuple[str, list[dict], dict]:
    """One foreign line -> (schema, prompt messages, store result); raises BadRow."""
    convo = _conversation(row)
    if convo is None:
        if row.get("id") in prompts:
            convo = prompts[row["id"]]
        else:
            raise BadRow("no prompt: expected prompt, messages, conversations or a known id")
    answer, reasoning, calls = _answer(row), _reasoning(row), _calls(row)
    if answer is None:
        if not convo or convo[-1]["role"] != "assistant":
            raise BadRow("no answer: expected response/text/content or a final assistant turn")
        last = convo[-1]
        answer, reasoning = last["content"], reasoning or last.get("reasoning_content")
        calls = calls or last.get("tool_calls")
    prompt = prompt_of(convo)
    usage = row.get("usage") if isinstance(row.get("usage"), dict) else {}
    meta = row.get("meta_info") if isinstance(row.get("meta_info"), dict) else {}
    output_ids = _output_ids(row)
    schema = "sglang" if output_ids is not None or meta else "openai"
    server = _server_tokens(row, usage, meta)
    tokens = len(output_ids) if output_ids is not None else server
    if tokens is None:
        tokens = count((reasoning or "") + answer)
    cost = row.get("cost", usage.get("cost"))
    if cost is not None and not isinstance(cost, int | float):
        raise BadRow(f"cost: expected a number, got {cost!r}")
    result = {
        "response": answer,
        "reasoning": reasoning,
        "output_ids": output_ids,
        "prompt_tokens": row.get("prompt_tokens", usage.get("prompt_tokens"))
        or meta.get("prompt_tokens"),
        "completion_tokens": tokens,
        "server_completion_tokens": server,
        "finish_reason": _finish(row),
        "model": row.get("model"),
        "cost": cost,
        "latency_s": row.get("latency_s"),
        "attempts": row.get("attempts", 1),
        "meta": {"imported": True, **({"meta_info": meta} if meta else {})},
    }
    if calls:
        result["tool_calls"] = calls
    return schema, prompt, result


def import_file(params: Params, dataset: str, path: Path) -> dict:
    """Normalize every line of `path` into the store, all or nothing; return a summary."""
    _, j = resolve_stage("responses", params, dataset)
    g = grammar(j.grammar)
    records = {p["id"]: p for p in read_jsonl(j.prompts)}
    prompts = {pid: p["messages"] for pid, p in records.items()}
    of_dataset = {j.key(p): p for p in records.values()}
    by_messages = {dumps(p["messages"]): p for p in records.values()}
    streams = Streams(j)
    tokenizer: list[Any] = []

    def count(text: str) -> int:
        if not tokenizer:
            from eaglet.model.target import load_tokenizer

            tokenizer.append(load_tokenizer(j.target))
        return len(tokenizer[0](text, add_special_tokens=False)["input_ids"])

    summary = {"records": 0, "new": 0, "in_dataset": 0, "completion_tokens": 0, "cost": 0.0}
    schemas: Counter = Counter()
    store = Store(j.store, Origin("imported", j.params_name, dataset))  # never charged as spend
    try:
        with store.transaction():
            for line, row, error in iter_rows(path):
                try:
                    if error is not None:
                        raise BadRow(error)
                    schema, prompt, result = normalize(row, prompts, count)
                    prompt = rename_calls(prompt, g)
                except BadRow as e:
                    raise EagletError(f"{path}:{line}: {e}") from None
                known = by_messages.get(dumps(prompt))  # a prompt of the dataset: in its mode
                key = j.key(known) if known else j.keyfn(prompt)
                new = not store.get_many([key])
                if new and key in of_dataset:  # the stream it will be stored as: checked
                    rec = response_record(of_dataset[key], dict(result), "import", {})
                    if j.mode is not None:
                        rec["chat_template_kwargs"] = j.mode_of(known)
                    try:
                        streams.add(rec)  # one it cannot write is counted in its stats
                    except EagletError as e:
                        raise EagletError(f"{path}:{line}: {e}") from None
                store.put(key, j.keyfn.backend, result)
                schemas[schema] += 1
                summary["records"] += 1
                if new:  # a row already in the store adds nothing: not counted again
                    summary["new"] += 1
                    summary["in_dataset"] += key in of_dataset
                    summary["completion_tokens"] += result["completion_tokens"]
                    summary["cost"] += result["cost"] or 0.0
    finally:
        store.close()
    if not summary["records"]:
        raise EagletError(f"{path}: no records")
    return {**summary, "schemas": dict(schemas), **streams.stats()}
