"""Kimi's stream, the last mile: what the model emitted is what is stored, in the four cases where
rebuilding it from an API's pieces can go wrong. The miniature Kimi (its own tokenizer class,
which matches special text in its own `encode` as Kimi's does) answers through a loopback server
that parses by tokens as a Kimi server does; every stored span is compared with the tokens the
model emitted, and read back through vLLM's own kimi_k2 parsers in the mode the server runs.

1. a tool call with Kimi's own id (`functions.NAME:IDX`, the header it emitted) keeps it;
2. text holding `</think>` is the model's plain tokens: the record is left out, counted with its
   reason (or kept as those tokens), never a stop of the dataset;
3. an empty reasoning after a prompt that does not open `<think>` (K2-Thinking) is the
   `<think></think>` the model emitted, not nothing;
4. a marker the template writes and the tokenizer config does not list stops the target.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from eaglet.cli import main
from eaglet.errors import EagletError
from eaglet.formats.grammar import Answer, grammar
from eaglet.formats.io import read_json, read_jsonl
from eaglet.formats.stream import Parsers, Writer, agrees
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model.target import load_tokenizer, resolve
from eaglet.params import load

from ...conftest import write_params
from ...kimi_api import KimiAPI, Plain, stream_ids
from ...kimi_fixture import tiny_kimi

KEY_ENV = "EAGLET_TEST_KIMI_STREAM_KEY"
LIST_FILES = {
    "type": "function",
    "function": {
        "name": "list_files",
        "description": "Files in a folder",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
}
CALL_EMITTED = (  # Kimi numbered this call 4: its own count, not eaglet's (1)
    "Look in src.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.list_files:4"
    '<|tool_call_argument_begin|>{"path": "src"}<|tool_call_end|><|tool_calls_section_end|>'
    "<|im_end|>"
)
AGENT = {
    "tools": [LIST_FILES],
    "messages": [
        {"role": "user", "content": "What is in the repo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.list_files:0",
                    "type": "function",
                    "function": {"name": "list_files", "arguments": '{"path": "."}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.list_files:0", "content": "src docs"},
        {"role": "user", "content": "And in src?"},
    ],
}
# the model wrote `</think>` inside its answer as ordinary tokens (a question about the tags)
LITERAL = ["Explain the tag.", "</think>", "Write ", Plain("</think>"), " to close it.<|im_end|>"]
STREAMS = {
    "And in src?": CALL_EMITTED,
    "Which tag closes thinking?": LITERAL,
    "Say hi.": "Greeting.</think>Hi.<|im_end|>",
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target")


@pytest.fixture(scope="module")
def tok(kimi):
    return load_tokenizer(resolve(str(kimi), trust=True))


def _project(project, kimi, url: str, **generation) -> list[str]:
    shutil.copytree(kimi, project / "target", dirs_exist_ok=True)
    chats = [{"messages": [{"role": "user", "content": q}]} for q in list(STREAMS)[1:]]
    for name, rows in (("agent", [AGENT]), ("chat", chats)):
        (project / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {
        "target": {
            "model": "target",
            "max_length": 512,
            "trust_remote_code": True,
            "grammar": "kimi_k2",
        },
        "backends": {
            "api": {
                "kind": "openai",
                "base_url": f"{url}/v1",
                "model": "moonshotai/kimi-k2.5",
                "api_key_env": KEY_ENV,
                "concurrency": 2,
                "reasoning_field": "reasoning_content",
            }
        },
        "generation": {"backend": "api", "max_new_tokens": 64, "turns": "last", **generation},
        "datasets": {
            "agent": {"path": "agent.jsonl", "format": "agent"},
            "chat": {"path": "chat.jsonl", "format": "ultrachat"},
        },
    }
    return ["--params", str(write_params(project, data))]


def _server(tok, monkeypatch, streams=STREAMS) -> KimiAPI:
    monkeypatch.setenv(KEY_ENV, "sk-test")
    return KimiAPI(tok, streams, field="reasoning_content", ids="kimi").start()


def _read_back(tok, rec: dict, thinking: bool = True) -> Answer:
    """The stored span through vLLM's kimi_k2 parsers in the server's mode."""
    text = tok.decode(rec["output_ids"]).removesuffix("<|im_end|>")
    return Parsers(grammar("kimi_k2"), tok).parse(
        "", text, rec.get("tools"), {"thinking": thinking}
    )


def test_a_call_id_kimi_emitted_is_kept_and_a_literal_marker_leaves_one_record_out(
    kimi, tok, project, monkeypatch, capsys
):
    """Moonshot-shaped answers (reasoning_content, the parser's ids): the call id
    `functions.list_files:4` is stored as emitted; the answer holding a plain `</think>` is
    left out with its reason in the sidecar and in status, and the dataset finishes."""
    server = _server(tok, monkeypatch)
    try:
        args = _project(project, kimi, server.url)
        for ds in ("agent", "chat"):
            assert main(["prompts", ds, *args]) == 0
            assert main(["generate", ds, "--quiet", *args]) == 0
    finally:
        server.stop()
    keys = Keys(load(args[1]))
    [agent] = list(read_jsonl(keys.path("responses", "agent")))
    assert agent["output_ids"] == stream_ids(tok, CALL_EMITTED)  # token for token
    assert [c["id"] for c in agent["tool_calls"]] == ["functions.list_files:4"]
    got = _read_back(tok, agent)
    assert [c.id for c in got.calls] == ["functions.list_files:4"]
    assert agrees(got, Answer.of(agent)) is None
    [hi] = list(read_jsonl(keys.path("responses", "chat")))
    assert hi["output_ids"] == stream_ids(tok, STREAMS["Say hi."])
    stats = read_json(keys.sidecar("responses", "chat"))["stats"]
    assert stats["responses"] == 1 and stats["from_grammar"] == 1
    [left] = stats["unwritable"]["first"]
    assert stats["unwritable"]["count"] == 1
    assert "content holds the text '</think>'" in left["reason"]
    prompts = {
        p["messages"][-1]["content"]: p["id"] for p in read_jsonl(keys.path("prompts", "chat"))
    }
    assert left["id"] == prompts["Which tag closes thinking?"]
    capsys.readouterr()
    assert main(["status", *args]) == 0
    out = capsys.readouterr().out
    assert f"1 left out (first {left['id']}: content holds the text '</think>'" in out


def test_a_literal_marker_kept_is_the_models_plain_tokens(kimi, tok, project, monkeypatch):
    """`generation.marker_text: keep`: the answer holding a plain `</think>` is stored as the
    tokens the model emitted (the plain ones where it wrote the text, the marker's id where it
    closed its thought)."""
    server = _server(tok, monkeypatch)
    try:
        args = _project(project, kimi, server.url, marker_text="keep")
        assert main(["prompts", "chat", *args]) == 0
        assert main(["generate", "chat", "--quiet", *args]) == 0
    finally:
        server.stop()
    keys = Keys(load(args[1]))
    recs = {r["messages"][-1]["content"]: r for r in read_jsonl(keys.path("responses", "chat"))}
    kept = recs["Which tag closes thinking?"]
    emitted = stream_ids(tok, LITERAL)
    assert kept["output_ids"] == emitted
    end_think = tok.convert_tokens_to_ids("</think>")
    assert emitted.count(end_think) == 1  # the marker once; the text's </think> is plain
    assert kept["response"] == "Write </think> to close it."
    assert read_json(keys.sidecar("responses", "chat"))["stats"]["unwritable"]["count"] == 0


def test_marker_text_in_instant_mode_reads_back_and_other_special_text_is_the_token(tok):
    """With thinking off the parsers have no `</think>`: an answer about it is written and read
    back as it was received, the marker's text as plain tokens. Another special token's text
    (`<|im_user|>`, not the grammar's) is that token: a server that keeps special tokens renders
    an emitted id so (formats/stream.py)."""
    text = "Close with </think>; roles start <|im_user|>."
    rec = {
        "id": "q",
        "messages": [{"role": "user", "content": "Tags?"}],
        "response": text,
        "reasoning": None,
        "finish_reason": "stop",
        "chat_template_kwargs": {"thinking": False},
    }
    ids = Writer(tok, grammar("kimi_k2")).output_ids(rec)
    emitted = stream_ids(
        tok, [Plain("Close with </think>; roles start "), "<|im_user|>", Plain("."), "<|im_end|>"]
    )
    assert ids == emitted
    assert tok.convert_tokens_to_ids("</think>") not in ids
    assert agrees(_read_back(tok, {"output_ids": ids}, thinking=False), Answer.of(rec)) is None


K2_THINKING_PROMPT = (
    "<|im_assistant|>assistant<|im_middle|>{% if off %}<think></think>{% else %}<think>{% endif %}"
)


def _k2_thinking(kimi, dest):
    """The miniature with K2-Thinking's generation prompt: it ends at `<|im_middle|>`, and the
    model opens `<think>` itself."""
    shutil.copytree(kimi, dest)
    template = dest / "chat_template.jinja"
    text = template.read_text()
    assert K2_THINKING_PROMPT in text
    template.write_text(text.replace(K2_THINKING_PROMPT, "<|im_assistant|>assistant<|im_middle|>"))
    return dest


def test_empty_reasoning_after_a_k2_thinking_prompt_is_the_think_pair_emitted(
    kimi, tmp_path, project, monkeypatch
):
    """The model thought nothing: it emitted `<think></think>Hi there!`; the API returned
    `reasoning_content: ""`. Stored as emitted (not `Hi there!<|im_end|>`, which vLLM's parser
    in its thinking mode reads as reasoning), and read back by it to the answer received."""
    target = _k2_thinking(kimi, tmp_path / "k2")
    tok = load_tokenizer(resolve(str(target), trust=True))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Greet me."}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_middle|>")
    emitted = "<think></think>Hi there!<|im_end|>"
    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, {"Greet me.": emitted}, field="reasoning_content").start()
    try:
        args = _project(project, target, server.url)
        (project / "chat.jsonl").write_text(
            json.dumps({"messages": [{"role": "user", "content": "Greet me."}]}) + "\n"
        )
        assert main(["prompts", "chat", *args]) == 0
        assert main(["generate", "chat", "--quiet", *args]) == 0
        assert server.bodies[0]["messages"][-1]["content"] == "Greet me."
    finally:
        server.stop()
    keys = Keys(load(args[1]))
    [rec] = list(read_jsonl(keys.path("responses", "chat")))
    assert rec["output_ids"] == stream_ids(tok, emitted)
    got = _read_back(tok, rec)  # the server's mode: vLLM's kimi_k2 default, thinking
    assert (got.reasoning, got.content) == ("", "Hi there!")
    assert agrees(got, Answer.of(rec)) is None
    # the mode decides, not the text: an answer without reasoning in instant mode
    no_think = grammar("kimi_k2").write(prompt, Answer("", "Hi there!"), {"thinking": False})
    assert no_think == "Hi there!<|im_end|>"


def test_a_template_marker_the_config_does_not_list_stops_the_target(kimi, tmp_path):
    """`<|im_middle|>` dropped from tokenizer_config.json's added tokens: the class splits it;
    the template writes it in every turn, so the target stops naming it, without telling a
    trusted target to trust its code."""
    target = tmp_path / "target"
    shutil.copytree(kimi, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    middle = next(
        k for k, t in config["added_tokens_decoder"].items() if t["content"] == "<|im_middle|>"
    )
    del config["added_tokens_decoder"][middle]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(EagletError) as e:
        load_tokenizer(resolve(str(target), trust=True))
    msg = str(e.value)
    assert "chat template marker '<|im_middle|>' encodes to [" in msg
    assert "does not list it" in msg and "target.trust_remote_code is on" in msg
    assert "\n" not in msg


def test_an_import_counts_only_what_is_new(kimi, tok, project, monkeypatch, capsys):
    """The same answer imported twice: the second import adds nothing, counts no tokens and no
    drift."""
    server = _server(tok, monkeypatch)
    try:
        args = _project(project, kimi, server.url)
    finally:
        server.stop()
    assert main(["prompts", "chat", *args]) == 0
    ids = stream_ids(tok, STREAMS["Say hi."])
    row = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "reasoning_content": "Greeting.",
        "response": "Hi.",
        "usage": {"completion_tokens": len(ids)},
    }
    raw = project / "raw.jsonl"
    raw.write_text(json.dumps(row) + "\n")
    capsys.readouterr()
    assert main(["import-responses", "chat", str(raw), *args]) == 0
    first = capsys.readouterr().out
    assert "1 new in the store" in first and f"{len(ids)} completion tokens" in first
    assert "drift 0.00%" in first
    assert main(["import-responses", "chat", str(raw), *args]) == 0
    again = capsys.readouterr().out
    assert "0 new in the store" in again and " 0 completion tokens" in again
    assert "drift" not in again


def test_status_names_why_the_responses_stage_stopped(kimi, tok, project, monkeypatch, capsys):
    """An import whose token count drifts past the limit: the stage stops; status says so, with
    both counts and the record."""
    server = _server(tok, monkeypatch)  # answers the other prompt
    try:
        args = _project(project, kimi, server.url)
        assert main(["prompts", "chat", *args]) == 0
        ids = stream_ids(tok, STREAMS["Say hi."])
        row = {
            "messages": [{"role": "user", "content": "Say hi."}],
            "text": "Hi.",
            "output_ids": ids,
            "meta_info": {"completion_tokens": len(ids) - 3, "finish_reason": {"type": "stop"}},
        }
        (project / "raw.jsonl").write_text(json.dumps(row) + "\n")
        assert main(["import-responses", "chat", str(project / "raw.jsonl"), *args]) == 0
        capsys.readouterr()
        assert main(["generate", "chat", "--quiet", *args]) == 2
    finally:
        server.stop()
    keys = Keys(load(args[1]))
    assert not keys.path("responses", "chat").exists()
    assert main(["status", *args]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "stopped:" in x)
    assert f"{len(ids)} stored, {len(ids) - 3} counted by the server" in line
    hi = next(
        p
        for p in read_jsonl(keys.path("prompts", "chat"))
        if p["messages"][-1]["content"] == "Say hi."
    )
    assert f"worst record {hi['id']}" in line
    assert not sidecar_of(keys.path("responses", "chat")).exists()


@pytest.mark.parametrize(
    ("field", "pieces", "answer"),
    [
        (
            "reasoning",
            [Plain("Is </think> a tag?"), "</think>", "Yes.<|im_end|>"],
            Answer("Is </think> a tag?", "Yes."),
        ),
        (
            "tool_calls[0].arguments",
            [
                "Parse it.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.grep:0"
                "<|tool_call_argument_begin|>",
                Plain('{"pattern": "</think>"}'),
                "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
            ],
            None,
        ),
    ],
)
def test_marker_text_in_reasoning_or_arguments_is_named_or_kept(tok, field, pieces, answer):
    """A plain `</think>` in the reasoning or in a call's arguments: skipped naming the field,
    or (keep) stored as exactly the tokens the model emitted."""
    from eaglet.formats.grammar import Call
    from eaglet.formats.stream import Unwritable

    if answer is None:
        answer = Answer("Parse it.", "", (Call("functions.grep:0", "grep", pieces[1]),))
    rec = {
        "id": "r",
        "messages": [{"role": "user", "content": "Tags?"}],
        "reasoning": answer.reasoning,
        "response": answer.content,
        "finish_reason": "stop",
    }
    if answer.calls:
        c = answer.calls[0]
        rec["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        ]
    with pytest.raises(Unwritable, match=rf"^{re.escape(field)} holds the text '</think>'"):
        Writer(tok, grammar("kimi_k2")).output_ids(rec)
    kept = Writer(tok, grammar("kimi_k2"), keep_marker_text=True).output_ids(rec)
    assert kept == stream_ids(tok, pieces)


def test_trajectory_ids_kimi_wrote_are_kept_and_foreign_ones_renamed():
    """A trajectory with Kimi's own ids numbered its way (3, then 7) keeps them, results
    following; a foreign id beside them becomes Kimi's form, counted over the conversation."""
    from eaglet.formats.grammar import rename_calls

    def call(cid: str, name: str) -> dict:
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}

    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("functions.ls:3", "ls")]},
        {"role": "tool", "tool_call_id": "functions.ls:3", "content": "a"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("functions.cat:7", "cat"), call("call_x", "cat")],
        },
        {"role": "tool", "tool_call_id": "functions.cat:7", "content": "b"},
        {"role": "tool", "tool_call_id": "call_x", "content": "c"},
    ]
    out = rename_calls(messages, grammar("kimi_k2"))
    ids = [c["id"] for m in out for c in m.get("tool_calls") or ()]
    assert ids == ["functions.ls:3", "functions.cat:7", "functions.cat:2"]
    assert [m["tool_call_id"] for m in out if m["role"] == "tool"] == ids
    # a Kimi-form id naming another function is foreign: vLLM would read that other name
    wrong = [messages[0], {**messages[1], "tool_calls": [call("functions.rm:0", "ls")]}]
    assert rename_calls(wrong, grammar("kimi_k2"))[1]["tool_calls"][0]["id"] == "functions.ls:0"


# a Kimi-K2-Instruct-like template: no `<think>` anywhere, the target never reasons
INSTRUCT = (
    "{% for m in messages %}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def test_a_template_that_never_thinks_writes_no_think_pair(kimi, tmp_path):
    """The same `<|im_middle|>` prompt ending as K2-Thinking's, but a template that never writes
    `<think>`: the target's mode is instant, so an answer without reasoning is the content and
    `<|im_end|>`, and vLLM's parser in instant mode reads it back."""
    target = tmp_path / "instruct"
    shutil.copytree(kimi, target)
    (target / "chat_template.jinja").write_text(INSTRUCT)
    tok = load_tokenizer(resolve(str(target), trust=True))
    rec = {
        "id": "i",
        "messages": [{"role": "user", "content": "Greet me."}],
        "response": "Hi there!",
        "reasoning": "",
        "finish_reason": "stop",
    }
    ids = Writer(tok, grammar("kimi_k2")).output_ids(rec)
    assert ids == stream_ids(tok, "Hi there!<|im_end|>")
    got = _read_back(tok, {"output_ids": ids}, thinking=False)
    assert agrees(got, Answer.of(rec)) is None
