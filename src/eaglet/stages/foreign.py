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
`content`, `output` or `choices[0].message.content`, else that final assistant turn. Completion
tokens: `completion_tokens`, `usage.completion_tokens`, `meta_info.completion_tokens`, the length
of `output_ids`, else counted with the target tokenizer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.datasets import BadRow, prompt_of, to_messages
from eaglet.formats.io import read_jsonl
from eaglet.formats.readers import iter_rows
from eaglet.formats.store import Store
from eaglet.params import Params
from eaglet.stages.generate import resolve

ANSWER_KEYS = ("response", "text", "content", "output")


def _conversation(row: dict) -> list[dict] | None:
    for key in ("prompt", "messages", "conversations"):
        if isinstance(row.get(key), list):
            return to_messages({key if key != "prompt" else "messages": row[key]}, "auto")
    return None


def _answer(row: dict) -> str | None:
    for key in ANSWER_KEYS:
        if isinstance(row.get(key), str):
            return row[key]
    choices = row.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        content = (choices[0].get("message") or {}).get("content")
        if isinstance(content, str):
            return content
    return None


def _finish(row: dict) -> str:
    meta = row.get("meta_info") if isinstance(row.get("meta_info"), dict) else {}
    choices = row.get("choices") if isinstance(row.get("choices"), list) else [{}]
    value = row.get("finish_reason") or meta.get("finish_reason") or choices[0].get("finish_reason")
    if isinstance(value, dict):
        value = value.get("type")
    return str(value) if value else "stop"


def normalize(row: dict, prompts: dict[str, list], count) -> tuple[str, list[dict], dict]:
    """One foreign line -> (schema, prompt messages, store result); raises BadRow."""
    convo = _conversation(row)
    if convo is None:
        if row.get("id") in prompts:
            convo = prompts[row["id"]]
        else:
            raise BadRow("no prompt: expected prompt, messages, conversations or a known id")
    answer = _answer(row)
    if answer is None:
        if not convo or convo[-1]["role"] != "assistant":
            raise BadRow("no answer: expected response/text/content or a final assistant turn")
        answer = convo[-1]["content"]
    prompt = prompt_of(convo)
    usage = row.get("usage") if isinstance(row.get("usage"), dict) else {}
    meta = row.get("meta_info") if isinstance(row.get("meta_info"), dict) else {}
    output_ids = row.get("output_ids")
    if output_ids is not None and not (
        isinstance(output_ids, list) and all(isinstance(i, int) for i in output_ids)
    ):
        raise BadRow("output_ids: expected a list of integers")
    schema = "sglang" if output_ids is not None or meta else "openai"
    tokens = next(
        (
            v
            for v in (
                row.get("completion_tokens"),
                usage.get("completion_tokens"),
                meta.get("completion_tokens"),
            )
            if v is not None
        ),
        None,
    )
    if tokens is None:
        tokens = len(output_ids) if output_ids is not None else count(answer)
    if not isinstance(tokens, int) or tokens < 0:
        raise BadRow(f"completion_tokens: expected a count, got {tokens!r}")
    cost = row.get("cost", usage.get("cost"))
    if cost is not None and not isinstance(cost, int | float):
        raise BadRow(f"cost: expected a number, got {cost!r}")
    result = {
        "response": answer,
        "reasoning": row.get("reasoning"),
        "output_ids": output_ids,
        "prompt_tokens": row.get("prompt_tokens", usage.get("prompt_tokens"))
        or meta.get("prompt_tokens"),
        "completion_tokens": tokens,
        "finish_reason": _finish(row),
        "model": row.get("model"),
        "cost": cost,
        "latency_s": row.get("latency_s"),
        "attempts": row.get("attempts", 1),
        "meta": {"imported": True, **({"meta_info": meta} if meta else {})},
    }
    return schema, prompt, result


def import_file(params: Params, dataset: str, path: Path) -> dict:
    """Normalize every line of `path` into the store, all or nothing; return a summary."""
    _, j = resolve(params, dataset)
    prompts = {p["id"]: p["messages"] for p in read_jsonl(j.prompts)}
    keys_of_dataset = {j.keyfn(m) for m in prompts.values()}
    tokenizer: list[Any] = []

    def count(text: str) -> int:
        if not tokenizer:
            from eaglet.model.target import load_tokenizer

            tokenizer.append(load_tokenizer(j.target))
        return len(tokenizer[0](text, add_special_tokens=False)["input_ids"])

    summary = {"records": 0, "new": 0, "in_dataset": 0, "completion_tokens": 0, "cost": 0.0}
    schemas: Counter = Counter()
    store = Store(j.store)
    try:
        with store.transaction():
            for line, row, error in iter_rows(path):
                try:
                    if error is not None:
                        raise BadRow(error)
                    schema, prompt, result = normalize(row, prompts, count)
                except BadRow as e:
                    raise EagletError(f"{path}:{line}: {e}") from None
                key = j.keyfn(prompt)
                if not store.get_many([key]):
                    summary["new"] += 1
                store.put(key, j.keyfn.backend, result)
                schemas[schema] += 1
                summary["records"] += 1
                summary["in_dataset"] += key in keys_of_dataset
                summary["completion_tokens"] += result["completion_tokens"]
                summary["cost"] += result["cost"] or 0.0
    finally:
        store.close()
    if not summary["records"]:
        raise EagletError(f"{path}: no records")
    return {**summary, "schemas": dict(schemas)}
