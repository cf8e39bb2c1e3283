"""Rendering conversations with the target's own chat template, as token ids."""

from __future__ import annotations

from typing import Any


def render(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, prompt: bool = False
) -> str:
    """The conversation as the target's own template (and tokenizer class) writes it, with the
    row's tool declarations; `prompt`: ending with the generation prompt."""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=False, **kw
    )


def prompt_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the prompt rendered with the generation prompt, as the target sees it."""
    text = render(tokenizer, messages, tools, prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's eos plus the model's own."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    if eos is None and model_config is not None:
        eos = getattr(model_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def assistant_turn(
    tokenizer: Any,
    messages: list[dict],
    response: str,
    reasoning: str | None = None,
    stop: list[int] | tuple[int, ...] = (),
    finished: bool = True,
    tools: list[dict] | None = None,
    tool_calls: list[dict] | None = None,
) -> tuple[list[int], list[int], bool]:
    """(prompt ids, turn ids, reasoning rendered) of `messages` + an assistant reply, by template.

    The turn is exactly what the full render adds after the render with the generation prompt,
    tokenized on its own (as the target generated it after the prompt), up to and including the
    last stop token; template text after that token is dropped, and an unfinished reply (cut by
    length) also drops the stop token it never produced. `reasoning` goes in as the message's
    `reasoning_content`, which reasoning templates (e.g. `<think>`) render and others ignore;
    `tool_calls` (OpenAI shape) are the reply's own calls, rendered by the template as well.
    """
    from eaglet.errors import EagletError

    reply: dict[str, Any] = {"role": "assistant", "content": response}
    if reasoning:
        reply["reasoning_content"] = reasoning
    if tool_calls:
        reply["tool_calls"] = tool_calls
    prompt = render(tokenizer, messages, tools, prompt=True)
    full = render(tokenizer, [*messages, reply], tools)
    if not full.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), None)
        at = min(len(prompt), len(full)) if at is None else at
        raise EagletError(
            "chat template: the render with the generation prompt is not a prefix of the render "
            f"with the assistant reply (they differ at character {at}: "
            f"{prompt[at : at + 20]!r} vs {full[at : at + 20]!r})"
        )
    turn = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    ends = [j for j, t in enumerate(turn) if t in stop]
    if ends:
        turn = turn[: ends[-1] + 1 if finished else ends[-1]]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids, turn, bool(reasoning) and reasoning in full
