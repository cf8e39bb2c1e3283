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
that read it back, registered in GRAMMARS; `tests/stages/responses/test_streams.py` shows what
it must pass.
"""

from __future__ import annotations

import json
import re
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


MARKER = "marker"  # the field of a piece that is one of the grammar's own tokens


class Grammar:
    name = ""
    end = ""  # the token that ends a turn
    markers: tuple[str, ...] = ()  # tokens the grammar writes: each must be one id
    reasoning_parser: str | None = None  # the serving engine's (vLLM's) parsers of this grammar
    tool_parser: str | None = None
    thinks = False  # the mode its serving parsers run in when nothing says otherwise
    opens = ""  # the marker that opens reasoning: a template that never writes it never thinks

    def call_id(self, name: str, index: int, given: str) -> str:
        """The id the target writes for the `index`-th call (0-based, counted over the whole
        conversation) of function `name`; `given` is the dataset's or the API's."""
        return given

    def thinking(self, prompt: str, mode: dict | None = None) -> bool:
        """Whether the target reasons after this generation prompt, in `mode` (the template
        arguments it is served with, `{"thinking": False}`; None: the template's default)."""
        return False

    def pieces(
        self, prompt: str, answer: Answer, mode: dict | None = None
    ) -> list[tuple[str, str]]:
        """The stream as (field, text) pieces: the grammar's markers (field MARKER, each one
        token) and the answer's text (`reasoning`, `content`, `tool_calls[k].id` ...)."""
        raise NotImplementedError

    def write(self, prompt: str, answer: Answer, mode: dict | None = None) -> str:
        return "".join(text for _, text in self.pieces(prompt, answer, mode))

    def parse(self, prompt: str, text: str, mode: dict | None = None) -> Answer:
        """eaglet's own reading of a stream (the end token stripped by the caller)."""
        raise NotImplementedError


class ChatML(Grammar):
    name = "chatml"
    end = "<|im_end|>"
    markers = ("<|im_end|>",)

    def pieces(
        self, prompt: str, answer: Answer, mode: dict | None = None
    ) -> list[tuple[str, str]]:
        if answer.reasoning:
            raise GrammarError(f"the {self.name} grammar has no reasoning, the answer has some")
        if answer.calls:
            raise GrammarError(f"the {self.name} grammar has no tool-call syntax")
        out = [("content", answer.content)]
        return out + ([(MARKER, self.end)] if answer.finished else [])

    def parse(self, prompt: str, text: str, mode: dict | None = None) -> Answer:
        return Answer("", text)


THINK, END_THINK = "<think>", "</think>"
SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


KIMI_ID = re.compile(r"functions\.(.+):\d+")  # the header Kimi emits for a call


class KimiK2(Grammar):
    name = "kimi_k2"
    end = "<|im_end|>"
    markers = (THINK, END_THINK, SECTION, SECTION_END, CALL, ARGS, CALL_END, "<|im_end|>")
    reasoning_parser = tool_parser = "kimi_k2"
    thinks = True  # vLLM's kimi_k2 parsers without a `thinking` argument read reasoning first
    opens = THINK

    def call_id(self, name: str, index: int, given: str) -> str:
        """An id Kimi emitted (`functions.NAME:IDX` of this call's name) is kept as it is:
        renumbering it would store a header the model did not write. Others are foreign."""
        match = KIMI_ID.fullmatch(given)
        if match and match.group(1) == name:
            return given
        return f"functions.{name}:{index}"

    def thinking(self, prompt: str, mode: dict | None = None) -> bool:
        """K2.5's generation prompt opens `<think>` when thinking and closes it when not; after
        one that ends at `<|im_middle|>` (K2-Thinking) the target's mode decides: the
        template's switch as served, else the mode the server's parsers run in."""
        if prompt.endswith(THINK + END_THINK):
            return False
        if prompt.endswith(THINK):
            return True
        if mode:
            return bool(next(iter(mode.values())))
        return self.thinks

    def pieces(
        self, prompt: str, answer: Answer, mode: dict | None = None
    ) -> list[tuple[str, str]]:
        cut_in_reasoning = not answer.finished and not answer.content and not answer.calls
        close = [] if cut_in_reasoning else [(MARKER, END_THINK)]  # a length cap ends mid-thought
        thinking = self.thinking(prompt, mode)
        if not thinking:
            if answer.reasoning:
                raise GrammarError("reasoning in an answer to a prompt with thinking off")
            head = []
        elif prompt.endswith(THINK):
            head = [("reasoning", answer.reasoning), *close]
        else:  # the target opens <think> itself, closing it even on an empty thought
            head = [(MARKER, THINK), ("reasoning", answer.reasoning), *close]
        body = [("content", answer.content)]
        if answer.calls:
            body.append((MARKER, SECTION))
            for k, c in enumerate(answer.calls):
                body += [(MARKER, CALL), (f"tool_calls[{k}].id", c.id), (MARKER, ARGS)]
                body += [(f"tool_calls[{k}].arguments", c.arguments), (MARKER, CALL_END)]
            body.append((MARKER, SECTION_END))
        end = [(MARKER, self.end)] if answer.finished else []
        return [(f, t) for f, t in head + body + end if t]

    def parse(self, prompt: str, text: str, mode: dict | None = None) -> Answer:
        """As vLLM's parsers in the same mode: thinking, all is reasoning up to `</think>` or
        the tool-call section (a stream cut inside its thought is all reasoning)."""
        reasoning = ""
        if self.thinking(prompt, mode):
            text = text.removeprefix(THINK)
            if END_THINK in text:
                reasoning, _, text = text.partition(END_THINK)
            else:
                reasoning, section, rest = text.partition(SECTION)
                text = section + rest
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
    """The conversation with every tool call id the target's own (`g.call_id`: an id the
    target emitted kept, a foreign one renamed, calls counted over the conversation) and each
    tool result's `tool_call_id` following its call."""
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
