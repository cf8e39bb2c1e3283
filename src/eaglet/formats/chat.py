"""Rendering conversations with the target's own chat template, as token ids."""

from __future__ import annotations

from typing import Any


def render(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    prompt: bool = False,
    mode: dict | None = None,
) -> str:
    """The conversation as the target's own template (and tokenizer class) writes it, with the
    row's tool declarations; `prompt`: ending with the generation prompt; `mode`: the template
    arguments of the mode it is served in (`{"thinking": False}`), as `chat_template_kwargs`."""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=False, **kw, **(mode or {})
    )


def prompt_ids(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, mode: dict | None = None
) -> list[int]:
    """Token ids of the prompt rendered with the generation prompt, as the target sees it."""
    text = render(tokenizer, messages, tools, prompt=True, mode=mode)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's eos plus the model's own."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    if eos is None and model_config is not None:
        eos = getattr(model_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)
