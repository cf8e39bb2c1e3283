"""The generated part of a sample: exactly the tokens the target emitted after its prompt.

Engines that return token ids (SGLang `/generate`, vLLM, in-process) give them as they are. For
text backends the answer's reasoning, content and tool calls are written in the target's output
grammar (`formats/grammar.py`) after the prompt its template renders with the generation prompt,
tokenized, and proven by round trip: decoded, the stream must parse back through the serving
engine's own reasoning and tool-call parsers (vLLM's, where installed; else eaglet's reading of
the grammar, and the sidecar says which), in the mode the target is served in, to what was
received. One that does not stops the stage naming the record.

Only the grammar's own markers are written as their ids; in the answer's text pieces a marker's
text is plain tokens: text that holds `</think>` was written by the model as plain tokens (a
marker it emitted would have been consumed by the server's parser). Any other special token's
text is that token: a server renders an emitted special id as its text when it keeps special
tokens (vLLM does for Kimi's tool parser), and a model spells `<|reserved_token_5|>` in plain
characters far more rarely than it emits the id; the drift check stands behind both. When such text
makes the parsers read the stream otherwise, the record cannot be written as the model's stream:
it is `Unwritable`, counted and skipped with its reason (or kept as plain tokens, by
`generation.marker_text: keep`), never a stop of the dataset.

Token counts: the stored count is the stream's length; the server's count (`usage.
completion_tokens`, which counts reasoning, or SGLang's `meta_info`) is kept beside it, and their
gap per dataset is the drift a stage checks against `generation.max_token_drift`.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.chat import render
from eaglet.formats.grammar import MARKER, Answer, Call, Grammar, GrammarError


class RoundTripError(EagletError):
    """A written stream that the engine's parsers do not read back to the answer received."""


class Unwritable(EagletError):
    """An answer whose text cannot be written as the target's stream (text holding one of the
    grammar's markers): one record, skipped with this reason."""


def added_ids(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added tokens (special or not): id -> text."""
    own = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): getattr(t, "content", str(t)) for i, t in own.items()}


def plain_ids(tokenizer: Any, text: str, added: dict[int, str]) -> list[int]:
    """`text` as ordinary tokens, special-token matching off. Text without any added token's
    text is tokenized as always (the same ids); Kimi's class matches special text in its own
    `encode` whatever `split_special_tokens` says, so its switch (`allow_special_tokens`) is
    asked next. Raises Unwritable when the tokenizer offers no way."""
    if not any(t in text for t in added.values()):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if any(i in added for i in ids):
        with contextlib.suppress(TypeError):  # a class without that switch
            ids = list(tokenizer.encode(text, allow_special_tokens=False))
    if found := [added[i] for i in ids if i in added]:
        raise Unwritable(
            f"{type(tokenizer).__name__} tokenizes the text {found[0]!r} as its special token "
            "even with special-token matching off"
        )
    return ids


def text_ids(
    tokenizer: Any, text: str, added: dict[int, str], markers: tuple[str, ...]
) -> list[int]:
    """A text piece of an answer as the model emitted it: each added token's text that is not
    one of the grammar's `markers` as that token (as the tokenizer itself reads it), the rest
    (markers' text included) as plain tokens."""
    specials = {t: i for i, t in added.items() if t not in markers}
    found = [t for t in specials if t in text]
    if not found:
        return plain_ids(tokenizer, text, added)
    cut = re.compile("|".join(re.escape(t) for t in sorted(found, key=len, reverse=True)))
    ids: list[int] = []
    start = 0
    for m in cut.finditer(text):
        if m.start() > start:
            ids += plain_ids(tokenizer, text[start : m.start()], added)
        ids.append(specials[m.group()])
        start = m.end()
    if start < len(text):
        ids += plain_ids(tokenizer, text[start:], added)
    return ids


class Parsers:
    """The serving engine's parsers of `grammar` (vLLM's registries), or eaglet's reading."""

    def __init__(self, grammar: Grammar, tokenizer: Any):
        self.grammar, self.tokenizer = grammar, tokenizer
        self.reasoning_cls = self.tool_cls = None
        self.source = "eaglet"
        self._built: dict = {}  # parsers built once per mode: each reads the whole vocabulary
        if grammar.reasoning_parser or grammar.tool_parser:
            try:
                import vllm
                from vllm.reasoning import ReasoningParserManager
                from vllm.tool_parsers import ToolParserManager
            except ImportError:
                return
            if grammar.reasoning_parser:
                self.reasoning_cls = ReasoningParserManager.get_reasoning_parser(
                    grammar.reasoning_parser
                )
            if grammar.tool_parser:
                self.tool_cls = ToolParserManager.get_tool_parser(grammar.tool_parser)
            self.source = f"vllm {vllm.__version__}"

    def parse(
        self, prompt: str, text: str, tools: list[dict] | None, mode: dict | None = None
    ) -> Answer:
        """The answer the engine's parsers read from `text`, in the mode the target is served
        in after `prompt` (`mode`: the template arguments; the grammar decides)."""
        if self.source == "eaglet":
            return self.grammar.parse(prompt, text, mode)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            model="eaglet", messages=[{"role": "user", "content": "-"}], tools=tools or None
        )
        reasoning, content = None, text
        if self.reasoning_cls is not None:
            thinking = self.grammar.thinking(prompt, mode)
            parser = self._parser("reasoning", thinking)
            reasoning, content = parser.extract_reasoning(text, request)
        calls: tuple[Call, ...] = ()
        if self.tool_cls is not None and content:
            info = self._parser("tool", None).extract_tool_calls(content, request)
            if info.tools_called:
                content = info.content or ""
                calls = tuple(
                    Call(c.id or "", c.function.name, c.function.arguments) for c in info.tool_calls
                )
        return Answer(reasoning or "", content or "", calls)

    def _parser(self, kind: str, thinking: bool | None):
        """One parser per kind and mode, reused: its non-streaming calls keep no state."""
        if (kind, thinking) not in self._built:
            if kind == "reasoning":
                kw = {"chat_template_kwargs": {"thinking": thinking}}
                self._built[kind, thinking] = self.reasoning_cls(self.tokenizer, **kw)
            else:
                self._built[kind, thinking] = self.tool_cls(self.tokenizer)
        return self._built[kind, thinking]


def agrees(got: Answer, want: Answer) -> str | None:
    """What differs between the parsed stream and the answer received, or None. The engine's
    parsers trim trailing reasoning whitespace and whitespace-only content before tool calls;
    nothing else is forgiven."""
    if got.reasoning.rstrip() != want.reasoning.rstrip():
        return f"reasoning {got.reasoning[:40]!r} != {want.reasoning[:40]!r}"
    content_got, content_want = got.content, want.content
    if want.calls:
        content_got, content_want = content_got.strip(), content_want.strip()
    if content_got != content_want:
        return f"content {got.content[:40]!r} != {want.content[:40]!r}"
    a = [(c.id, c.name, c.arguments.strip()) for c in got.calls]
    b = [(c.id, c.name, c.arguments.strip()) for c in want.calls]
    if a != b:
        return f"tool calls {a} != {b}"
    return None


@dataclass
class Writer:
    """Writes text answers as the target's output stream, for one dataset."""

    tokenizer: Any
    grammar: Grammar
    parsers: Parsers | None = None
    written: int = 0
    keep_marker_text: bool = False  # generation.marker_text: keep
    _markers: dict[str, int] | None = None

    def marker_ids(self) -> dict[str, int]:
        """Each of the grammar's markers as its one id; a target that splits one stops."""
        if self._markers is None:
            out = {}
            for m in self.grammar.markers:
                ids = self.tokenizer(m, add_special_tokens=False)["input_ids"]
                if len(ids) != 1:
                    raise EagletError(
                        f"target.grammar {self.grammar.name}: its marker {m!r} encodes to "
                        f"{ids}, not one id of the target's tokenizer"
                    )
                out[m] = ids[0]
            self._markers = out
        return self._markers

    def served(self, asked: dict | None) -> dict | None:
        """The mode the target answers in: the template arguments asked, else, for a template
        that never writes the grammar's opening marker (Kimi-K2-Instruct's), instant whatever
        the parsers' default; else None (the grammar decides)."""
        if asked is not None or not self.grammar.opens:
            return asked
        template = str(getattr(self.tokenizer, "chat_template", None) or "")
        return None if self.grammar.opens in template else {"thinking": False}

    def output_ids(self, rec: dict) -> list[int]:
        """The tokens of a text answer (a record without the engine's ids), written in the
        target's grammar and read back. Raises Unwritable for a record that cannot be written
        as the model's stream, EagletError naming what else is wrong."""
        self.written += 1
        asked = rec.get("chat_template_kwargs")
        prompt = render(self.tokenizer, rec["messages"], rec.get("tools"), prompt=True, mode=asked)
        mode = self.served(asked)
        answer = Answer.of(rec)
        try:  # an answer the grammar has no syntax for: the backend serves another model or
            # mode, which every record would show, so the stage stops
            pieces = self.grammar.pieces(prompt, answer, mode)
        except GrammarError as e:
            raise EagletError(f"response {rec['id']}: {self.grammar.name} grammar: {e}") from None
        markers, added = self.marker_ids(), added_ids(self.tokenizer)
        ids: list[int] = []
        for field, text in pieces:
            if field == MARKER:
                ids.append(markers[text])
            else:
                ids += text_ids(self.tokenizer, text, added, self.grammar.markers)
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False)
        if answer.finished:
            decoded = decoded.removesuffix(self.grammar.end)
        if self.parsers is None:
            self.parsers = Parsers(self.grammar, self.tokenizer)
        wrong = agrees(self.parsers.parse(prompt, decoded, rec.get("tools"), mode), answer)
        if wrong is None:
            return ids
        literal = marker_text(pieces, self.grammar)
        if literal is None:
            raise RoundTripError(
                f"response {rec['id']}: the written stream does not parse back through "
                f"{self.parsers.source}'s {self.grammar.name} parsers: {wrong}"
            )
        if not self.keep_marker_text:
            field, m = literal
            raise Unwritable(
                f"{field} holds the text {m!r}: written as the plain tokens the model emitted, "
                f"{self.parsers.source}'s {self.grammar.name} parsers read it as the marker "
                f"({wrong})"
            )
        self.check_pieces(rec["id"], pieces, ids)
        return ids

    def check_pieces(self, rid: str, pieces: list[tuple[str, str]], ids: list[int]) -> None:
        """A kept stream with marker text, read back by its ids (the parsers read text, where a
        plain-token `</think>` is the marker): cut at the grammar's marker ids, each text
        piece decodes to the answer's text."""
        ids_of = set(self.marker_ids().values())
        texts, run = [], []
        for i in [*ids, None]:
            if i is None or i in ids_of:
                if run:
                    texts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            else:
                run.append(i)
        want = [t for f, t in pieces if f != MARKER]
        if texts != want:
            raise RoundTripError(
                f"response {rid}: the kept stream's text pieces {texts[:3]} are not the "
                f"answer's {want[:3]}"
            )


def marker_text(pieces: list[tuple[str, str]], grammar: Grammar) -> tuple[str, str] | None:
    """The first text piece holding one of the grammar's markers as text: (field, marker)."""
    for field, text in pieces:
        if field == MARKER:
            continue
        for m in grammar.markers:
            if m in text:
                return field, m
    return None


@dataclass
class Drift:
    """Stored generated tokens against the server's count, over one dataset."""

    stored: int = 0
    server: int = 0
    gaps: int = 0  # sum of |stored - server| per record: opposite errors do not cancel
    records: int = 0
    worst: dict | None = None

    def add(self, rid: str, stored: int, server: int | None) -> None:
        if server is None:
            return
        self.records += 1
        self.stored += stored
        self.server += server
        gap = abs(stored - server)
        self.gaps += gap
        if gap and (self.worst is None or gap > self.worst["gap"]):
            self.worst = {"id": rid, "stored": stored, "server": server, "gap": gap}

    @property
    def ratio(self) -> float:
        return self.gaps / self.server if self.server else 0.0

    def summary(self) -> dict:
        return {
            "records": self.records,
            "stored_tokens": self.stored,
            "server_tokens": self.server,
            "drift": round(self.ratio, 6),
            "worst": self.worst,
        }

    def check(self, dataset: str, limit: float) -> None:
        if self.ratio > limit:
            w = self.worst or {}
            raise EagletError(
                f"responses {dataset}: generated tokens drift {self.ratio:.1%} from the server's "
                f"count (limit generation.max_token_drift {limit:.1%}); worst record {w.get('id')}:"
                f" {w.get('stored')} stored, {w.get('server')} counted by the server"
            )
