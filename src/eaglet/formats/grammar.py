"""A target family's output grammar: how the tokens a target emits after its generation prompt
spell its reasoning, answer, tool calls and end of turn.

Backends that return text (OpenAI-compatible APIs, imported files) give the pieces apart:
`reasoning`, `content`, `tool_calls`. The sample the drafter trains on is the stream the target
generated, so those pieces are written back in the target's own grammar, after the prompt as its
template renders it with the generation prompt; never through the template's rendering of a
finished conversation, which rewrites history (Kimi drops the reasoning of every assistant
message up to the last one without tool calls).

A grammar is named per target family in params (`target.grammar`):
    chatml   ChatML targets without reasoning or tool-call syntax (SmolLM2): content<|im_end|>
    kimi_k2  Kimi-K2 / K2-Thinking / K2.5 / K2.6:
             [reasoning</think>]content[<|tool_calls_section_begin|>
             <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
             <|tool_call_end|>...<|tool_calls_section_end|>]<|im_end|>
Adding one (Qwen3's `<think>\n..\n</think>\n\n` + Hermes `<tool_call>` JSON, say) is a subclass
of `Grammar` with `write`, `parse`, its markers and the names of the serving engine's parsers
that read it back, registered in GRAMMARS; `tests/test_streams.py` shows what it must pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eaglet.errors import EagletError


class GrammarError(EagletError):
    """An answer this grammar cannot write, or a stream it cannot read."""


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, exactly once


@dataclass(frozen=True)
class Answer:
    """What a target said in one turn, as backends return it apart."""

    reasoning: str
    content: str
    calls: tuple[Call, ...] = ()
    finished: bool = True  # ended by the target (its end token), not cut by a length cap

    @classmethod
    def of(cls, rec: dict) -> Answer:
        calls = tuple(
            Call(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in rec.get("tool_calls") or ()
        )
        return cls(
            rec.get("reasoning") or "",
            rec.get("response") or "",
            calls,
            rec.get("finish_reason") != "length",
        )


class Grammar:
    name = ""
    end = ""  # the token that ends a turn
    markers: tuple[str, ...] = ()  # tokens the grammar writes: each must be one id
    reasoning_parser: str | None = None  # the serving engine's (vLLM's) parsers of this grammar
    tool_parser: str | None = None

    def call_id(self, name: str, index: int, given: str) -> str:
        """The id the target writes for the `index`-th call (0-based, counted over the whole
        conversation) of function `name`; `given` is the dataset's or the API's."""
        return given

    def thinking(self, prompt: str) -> bool:
        """Whether the target reasons after this generation prompt."""
        return False

    def write(self, prompt: str, answer: Answer) -> str:
        raise NotImplementedError

    def parse(self, prompt: str, text: str) -> Answer:
        """eaglet's own reading of a stream (the end token stripped by the caller)."""
        raise NotImplementedError


class ChatML(Grammar):
    name = "chatml"
    end = "<|im_end|>"
    markers = ("<|im_end|>",)

    def write(self, prompt: str, answer: Answer) -> str:
        if answer.reasoning:
            raise GrammarError(f"the {self.name} grammar has no reasoning, the answer has some")
        if answer.calls:
            raise GrammarError(f"the {self.name} grammar has no tool-call syntax")
        return answer.content + (self.end if answer.finished else "")

    def parse(self, prompt: str, text: str) -> Answer:
        return Answer("", text)


THINK, END_THINK = "<think>", "</think>"
SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2(Grammar):
    name = "kimi_k2"
    end = "<|im_end|>"
    markers = (THINK, END_THINK, SECTION, SECTION_END, CALL, ARGS, CALL_END, "<|im_end|>")
    reasoning_parser = tool_parser = "kimi_k2"

    def call_id(self, name: str, index: int, given: str) -> str:
        return f"functions.{name}:{index}"

    def thinking(self, prompt: str) -> bool:
        """K2.5 opens `<think>` in the generation prompt when thinking, closes it when not;
        after a prompt that ends at `<|im_middle|>` (K2-Thinking) the target opens it itself,
        which the stream shows."""
        return prompt.endswith(THINK)

    def write(self, prompt: str, answer: Answer) -> str:
        cut_in_reasoning = not answer.finished and not answer.content and not answer.calls
        close = "" if cut_in_reasoning else END_THINK  # a length cap can end it mid-thought
        if prompt.endswith(THINK + END_THINK):
            if answer.reasoning:
                raise GrammarError("reasoning in an answer to a prompt with thinking off")
            head = ""
        elif prompt.endswith(THINK):
            head = answer.reasoning + close
        else:
            head = f"{THINK}{answer.reasoning}{close}" if answer.reasoning else ""
        body = answer.content
        if answer.calls:
            body += SECTION
            for c in answer.calls:
                body += f"{CALL}{c.id}{ARGS}{c.arguments}{CALL_END}"
            body += SECTION_END
        return head + body + (self.end if answer.finished else "")

    def parse(self, prompt: str, text: str) -> Answer:
        reasoning = ""
        if (self.thinking(prompt) or text.startswith(THINK)) and END_THINK in text:
            reasoning, _, text = text.partition(END_THINK)
            reasoning = reasoning.removeprefix(THINK)
        content, _, section = text.partition(SECTION)
        calls = []
        for part in section.removesuffix(SECTION_END).split(CALL)[1:]:
            header, _, args = part.partition(ARGS)
            name = header.rpartition(":")[0].removeprefix("functions.")
            calls.append(Call(header, name, args.removesuffix(CALL_END)))
        return Answer(reasoning, content, tuple(calls))


GRAMMARS: dict[str, Grammar] = {g.name: g for g in (ChatML(), KimiK2())}


def grammar(name: str) -> Grammar:
    try:
        return GRAMMARS[name]
    except KeyError:
        raise EagletError(
            f"target.grammar: unknown '{name}' (known: {', '.join(GRAMMARS)})"
        ) from None


def rename_calls(messages: list[dict], g: Grammar) -> list[dict]:
    """The conversation with every tool call id the target's own (`g.call_id`, calls counted
    over the conversation) and each tool result's `tool_call_id` following its call."""
    renamed: dict[str, str] = {}
    out, index = [], 0
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                new = g.call_id(c["function"]["name"], index, c["id"])
                renamed[c["id"]] = new
                calls.append({**c, "id": new})
                index += 1
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:
            m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
        out.append(m)
    return out


def count_calls(messages: list[dict]) -> int:
    return sum(len(m.get("tool_calls") or ()) for m in messages)


def answer_calls(calls: list[dict] | None, messages: list[dict], g: Grammar) -> list[dict]:
    """An answer's tool calls (OpenAI shape, as an API returns them) with the target's ids,
    counted after the calls of the conversation before it; arguments JSON text exactly once."""
    first = count_calls(messages)
    out = []
    for k, c in enumerate(calls or ()):
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        new = g.call_id(fn.get("name", ""), first + k, c.get("id") or f"call_{first + k}")
        out.append(
            {"id": new, "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out
