"""Every sample is what the target generated: the miniature Kimi-K2.5 (its own tokenizer class,
a template that keeps and drops what K2.5's does, `[EOS]` eos, tool-call markers `special:
false`) answering through an OpenRouter-shaped loopback server, through an import, and as agent
trajectories; each stored stream checked token by token against the stream the target emitted,
and read back through vLLM's own Kimi-K2 parsers."""

from __future__ import annotations

import json

import pytest

from eaglet.cli import main
from eaglet.formats.grammar import GRAMMARS, Answer, Call, grammar
from eaglet.formats.hidden_store import HiddenReader
from eaglet.formats.io import read_json, read_jsonl
from eaglet.formats.stream import Parsers, agrees
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model.target import load_tokenizer, resolve
from eaglet.params import load

from ...conftest import write_params
from ...kimi_api import KimiAPI
from ...kimi_fixture import IM_END, THINK, tiny_kimi

KEY_ENV = "EAGLET_TEST_KIMI_KEY"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def call(cid: str, city: str) -> dict:
    args = json.dumps({"city": city})
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}


# A1-style trajectories. The first is written with Kimi's own ids and the reasoning of its
# in-progress tool-call turn; the second as OpenAI clients write them (their ids, results
# without ids), which eaglet renames to what Kimi writes.
LYON = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What's the weather in Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need Lyon's weather.",
            "tool_calls": [call("functions.get_weather:0", "Lyon")],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "cloudy"}'},
        {"role": "user", "content": "And in Paris?"},
    ],
}
NICE = {
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "Weather in Nice and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [call("call_a", "Nice"), call("call_b", "Oslo")],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "snow"},
    ],
}
NICE_AS_KIMI_WRITES_IT = [
    NICE["messages"][0],
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            call("functions.get_weather:0", "Nice"),
            call("functions.get_weather:1", "Oslo"),
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
    {"role": "tool", "content": "snow", "tool_call_id": "functions.get_weather:1"},
]
CHATS = [{"messages": [{"role": "user", "content": q}]} for q in ("June in Paris?", "Tell a tale.")]

# What the target emitted after each prompt (its generation prompt ends `<think>`).
STREAMS = {
    "June in Paris?": "June in Paris has showers.</think>Pack a small umbrella.<|im_end|>",
    "Tell a tale.": "A short one.</think>Once upon a time there",  # cut by max_new_tokens
    "And in Paris?": (
        "Lyon done; now Paris.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    ),
    "Weather in Nice and Oslo?": "Both are in.</think>Nice is sunny; Oslo has snow.<|im_end|>",
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target")


@pytest.fixture(scope="module")
def tok(kimi):
    return load_tokenizer(resolve(str(kimi), trust=True))


@pytest.fixture
def api(tok, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, STREAMS).start()
    yield server
    server.stop()


def _project(project, kimi, url: str) -> list[str]:
    import shutil

    shutil.copytree(kimi, project / "target")
    for name, rows in (("a1", [LYON, NICE]), ("chat", CHATS)):
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
                "reasoning_field": "reasoning",
            }
        },
        # the turn after each recorded trajectory: one oracle stream a prompt (every turn of a
        # trajectory is test_turns.py's)
        "generation": {"backend": "api", "max_new_tokens": 64, "turns": "last"},
        "datasets": {
            "a1": {"path": "a1.jsonl", "format": "agent"},
            "chat": {"path": "chat.jsonl", "format": "ultrachat"},
        },
        "hidden": {"compute_dtype": "float32", "dtype": "float32", "threads": 2},
    }
    return ["--params", str(write_params(project, data))]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _prompt(tok, messages, tools=None) -> list[int]:
    kw = {"tools": tools} if tools else {}
    return _ids(
        tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    )


def test_api_answers_are_stored_as_the_stream_kimi_emitted(kimi, tok, api, project, capsys):
    """OpenRouter-shaped answers (reasoning apart, tool calls with the provider's ids): each
    stored sample is the prompt with K2.5's generation prompt, then exactly the emitted tokens;
    trajectory prompts equal the template over the raw messages, their reasoning kept."""
    args = _project(project, kimi, api.url)
    for stage in ("prompts", "generate", "hidden"):
        for ds in ("a1", "chat"):
            assert main([stage, ds, *args] + (["--quiet"] if stage != "prompts" else [])) == 0
    keys = Keys(load(args[1]))
    parsers = Parsers(grammar("kimi_k2"), tok)
    assert parsers.source.startswith("vllm")
    prompts = {
        "And in Paris?": _prompt(tok, LYON["messages"], LYON["tools"]),
        "Weather in Nice and Oslo?": _prompt(tok, NICE_AS_KIMI_WRITES_IT, NICE["tools"]),
        **{c["messages"][0]["content"]: _prompt(tok, c["messages"]) for c in CHATS},
    }
    shown = tok.decode(prompts["And in Paris?"])
    assert "namespace functions {" in shown  # tools in TypeScript: the class's own rendering
    assert "<think>Need Lyon's weather.</think><|tool_calls_section_begin|>" in shown
    assert "## Return of functions.get_weather:0" in shown
    seen = 0
    for ds in ("a1", "chat"):
        side = read_json(keys.sidecar("responses", ds))["stats"]
        kept = 2 if ds == "a1" else 1  # "Tell a tale." was cut at max_new_tokens: dropped
        assert side["token_drift"]["drift"] == 0 and side["token_drift"]["records"] == kept
        assert side["from_grammar"] == kept and side["round_trip"].startswith("vllm")
        assert side["truncated"]["dropped"] == 2 - kept
        reader = HiddenReader(keys.path("hidden", ds))
        for rec in read_jsonl(keys.path("responses", ds)):
            last = next(m["content"] for m in reversed(rec["messages"]) if m["role"] == "user")
            emitted = _ids(tok, STREAMS[last])
            assert rec["output_ids"] == emitted, last
            assert rec["completion_tokens"] == rec["server_completion_tokens"] == len(emitted)
            sample = reader.get(rec["id"])
            assert sample["input_ids"].tolist() == prompts[last] + emitted
            assert sample["loss_mask"].tolist() == [False] * len(prompts[last]) + [True] * len(
                emitted
            )
            assert prompts[last][-1] == THINK  # K2.5's generation prompt in thinking mode
            # read back by vLLM's own parsers: the reasoning, content and calls received
            text = tok.decode(emitted).removesuffix("<|im_end|>")
            got = parsers.parse("...<think>", text, rec.get("tools"))
            assert agrees(got, Answer.of(rec)) is None
            assert got.reasoning and got.reasoning == rec["reasoning"]
            seen += 1
    assert seen == 3
    paris = next(
        r
        for r in read_jsonl(keys.path("responses", "a1"))
        if r["messages"][-1]["content"] == "And in Paris?"
    )
    assert [c["id"] for c in paris["tool_calls"]] == ["functions.get_weather:1"]  # not call_...
    # the trajectory's reasoning reached the API in OpenRouter's field, ids as Kimi's
    sent = next(b for b in api.bodies if b["messages"][-1]["content"] == "And in Paris?")
    assert sent["messages"][2]["reasoning"] == "Need Lyon's weather."
    assert "reasoning_content" not in sent["messages"][2]
    assert main(["status", *args]) == 0
    assert "token drift 0.00%" in capsys.readouterr().out


def test_an_answer_rendered_through_the_history_path_is_caught(kimi, tok):
    """Rendering the answer as the last turn of a finished conversation (the template's history
    path) drops Kimi's reasoning: the tokens differ from the emitted stream, and the round trip
    through vLLM's parsers refuses it."""
    messages = CHATS[0]["messages"]
    answer = Answer("June in Paris has showers.", "Pack a small umbrella.")
    reply = {"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning}
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([*messages, reply], tokenize=False)
    history = full[len(prompt) :]
    assert history == "</think>Pack a small umbrella.<|im_end|>"  # the reasoning is gone
    assert _ids(tok, history) != _ids(tok, STREAMS["June in Paris?"])
    got = Parsers(grammar("kimi_k2"), tok).parse(prompt, history.removesuffix("<|im_end|>"), None)
    assert agrees(got, answer) is not None
    # the grammar writes what was emitted, and that reads back
    written = grammar("kimi_k2").write(prompt, answer)
    assert written == STREAMS["June in Paris?"]


def test_kimi_grammar_in_each_mode_and_its_calls(tok):
    g = GRAMMARS["kimi_k2"]
    calls = (Call("functions.f:3", "f", '{"a": 1}'),)
    on, off = "<|im_middle|><think>", "<|im_middle|><think></think>"
    assert g.write(on, Answer("r", "c")) == "r</think>c<|im_end|>"
    assert g.write(off, Answer("", "c")) == "c<|im_end|>"
    assert g.write("<|im_middle|>", Answer("r", "c")) == "<think>r</think>c<|im_end|>"
    assert g.write(on, Answer("r", "", finished=False)) == "r"  # cut inside the reasoning
    with pytest.raises(Exception, match="thinking off"):
        g.write(off, Answer("r", "c"))
    text = g.write(on, Answer("r", "", calls))
    assert text == (
        "r</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:3"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    k2 = "<|im_middle|>"  # K2-Thinking's prompt: the target opens <think> itself, or not at all
    cases = [(on, Answer("r", "", calls)), (off, Answer("", "c", calls))]
    cases += [(k2, Answer("r", "c")), (k2, Answer("", "c", calls))]
    for prompt, ans in cases:
        stream = g.write(prompt, ans).removesuffix("<|im_end|>")
        assert agrees(Parsers(g, tok).parse(prompt, stream, None), ans) is None
        assert agrees(g.parse(prompt, stream), ans) is None  # eaglet's own reading agrees
    chatml = GRAMMARS["chatml"]
    with pytest.raises(Exception, match="no reasoning"):
        chatml.write("", Answer("r", "c"))


def _import_rows(tok) -> list[dict]:
    """An OpenAI-style row (reasoning and calls under choices[0].message) and an SGLang row
    (the engine's output ids), as the user's old scripts wrote them."""
    paris = json.loads(
        json.dumps(
            {
                "prompt": LYON["messages"],
                "choices": [
                    {
                        "message": {
                            "content": None,
                            "reasoning_content": "Lyon done; now Paris.",
                            "tool_calls": [call("call_zz", "Paris")],
                        },
                        "finish_reason": "tool_calls",
                    }
                ],
                "usage": {"completion_tokens": len(_ids(tok, STREAMS["And in Paris?"]))},
            }
        )
    )
    ids = _ids(tok, STREAMS["Weather in Nice and Oslo?"])
    nice = {
        "messages": NICE["messages"],
        "text": "Nice is sunny; Oslo has snow.",
        "output_ids": ids,
        "meta_info": {"completion_tokens": len(ids), "finish_reason": {"type": "stop"}},
    }
    return [paris, nice]


def test_imported_answers_keep_reasoning_calls_and_ids(kimi, tok, api, project, capsys):
    args = _project(project, kimi, api.url)
    assert main(["prompts", "a1", *args]) == 0
    raw = project / "raw_responses.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in _import_rows(tok)))
    capsys.readouterr()
    assert main(["import-responses", "a1", str(raw), *args]) == 0
    out = capsys.readouterr().out
    assert "2 are prompts of a1" in out and "drift 0.00%" in out
    assert main(["generate", "a1", "--quiet", *args]) == 0
    assert not api.bodies  # every answer came from the import: nothing paid again
    keys = Keys(load(args[1]))
    for rec in read_jsonl(keys.path("responses", "a1")):
        last = next(m["content"] for m in reversed(rec["messages"]) if m["role"] == "user")
        assert rec["output_ids"] == _ids(tok, STREAMS[last])
    stats = read_json(sidecar_of(keys.path("responses", "a1")))["stats"]
    assert stats["from_grammar"] == 1 and stats["token_drift"]["drift"] == 0


def test_token_drift_past_the_threshold_stops_naming_the_record(kimi, tok, api, project, capsys):
    """An SGLang row with 7 output ids and completion_tokens 5: stored as 7, 5 kept beside; the
    responses stage stops naming the dataset and the record, and writes nothing."""
    args = _project(project, kimi, api.url)
    assert main(["prompts", "a1", *args]) == 0
    ids = _ids(tok, "on</think>the sea<|im_end|>")
    assert len(ids) == 7
    row = {"messages": NICE["messages"], "text": "the sea", "output_ids": ids}
    row["meta_info"] = {"completion_tokens": 5, "finish_reason": {"type": "stop"}}
    (project / "raw.jsonl").write_text(json.dumps(row) + "\n")
    capsys.readouterr()
    assert main(["import-responses", "a1", str(project / "raw.jsonl"), *args]) == 0
    assert "drift 40.00%" in capsys.readouterr().out
    keys = Keys(load(args[1]))
    assert main(["generate", "a1", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert "responses a1: generated tokens drift" in err and "7 stored, 5 counted" in err
    nice = next(r for r in read_jsonl(keys.path("prompts", "a1")) if len(r["messages"]) == 4)
    assert f"worst record {nice['id']}" in err
    assert not keys.path("responses", "a1").exists()
    assert IM_END in ids


QUESTIONS = [f"Question {i}?" for i in range(12)]
BOTH = {  # what the target emits after each question, in each mode
    q: {True: f"Weighing {q}</think>Answer {i}.<|im_end|>", False: f"Answer {i}.<|im_end|>"}
    for i, q in enumerate(QUESTIONS)
}


def test_thinking_off_and_a_mix_reach_the_server_and_the_stored_prompts(
    kimi, tok, project, monkeypatch
):
    """Thinking off: each request carries the switch and each stored sample starts from K2.5's
    thinking-off generation prompt (`<think></think>`). A 0.5 mix: both modes, drawn per
    prompt from its id and the seed (through OpenRouter's `reasoning.enabled`); the key
    records the mode and its share."""
    import random

    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, BOTH).start()
    try:
        args = _project(project, kimi, server.url)
        rows = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS]
        (project / "qs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = load(args[1]).data
        data["target"]["thinking_switch"] = "thinking"
        data["backends"]["or"] = dict(data["backends"]["api"], thinking_via="openrouter")
        data["datasets"] = {
            "off": {"path": "qs.jsonl", "format": "ultrachat", "thinking": False},
            "mix": {"path": "qs.jsonl", "format": "ultrachat", "thinking": "mix", "backend": "or"},
        }
        data.pop("extends", None)
        args = ["--params", str(write_params(project, data))]
        for stage in ("prompts", "generate", "hidden"):
            for ds in ("off", "mix"):
                assert main([stage, ds, *args] + (["--quiet"] if stage != "prompts" else [])) == 0
        keys = Keys(load(args[1]))
        for ds in ("off", "mix"):
            reader = HiddenReader(keys.path("hidden", ds))
            modes = []
            for rec in read_jsonl(keys.path("responses", ds)):
                q = rec["messages"][-1]["content"]
                on = ds == "mix" and random.Random(f"0:{rec['id']}").random() < 0.5
                assert rec["chat_template_kwargs"] == {"thinking": on}
                asked = [b for b in server.bodies if b["messages"][-1]["content"] == q]
                if ds == "off":  # the template argument, as vLLM and SGLang servers take it
                    [body] = [b for b in asked if "reasoning" not in b]  # one per prompt
                    assert body["chat_template_kwargs"] == {"thinking": False}
                elif on:  # OpenRouter's switch
                    [body] = [b for b in asked if "reasoning" in b]
                    assert body["reasoning"]["enabled"] is True
                    assert "chat_template_kwargs" not in body
                else:  # the same model in the same mode: the "off" answer, from the store
                    assert not [b for b in asked if "reasoning" in b]
                prompt = _ids(
                    tok,
                    tok.apply_chat_template(
                        rec["messages"], add_generation_prompt=True, tokenize=False, thinking=on
                    ),
                )
                assert tok.decode(prompt).endswith("<think>" if on else "<think></think>")
                emitted = _ids(tok, BOTH[q][on])
                assert rec["output_ids"] == emitted
                assert reader.get(rec["id"])["input_ids"].tolist() == prompt + emitted
                modes.append(on)
            side = read_json(keys.sidecar("responses", ds))["stats"]
            assert side["modes"] == {"thinking": sum(modes), "instant": len(modes) - sum(modes)}
            assert side["token_drift"]["drift"] == 0
        assert 0 < side["modes"]["thinking"] < 12  # the mix holds both modes
        mix = keys.spec("responses", "mix").values.mode
        assert mix == {"switch": "thinking", "thinking": "mix", "fraction": 0.5, "seed": 0}
        data["datasets"]["mix"]["thinking_fraction"] = 0.25
        other = Keys(load(write_params(project, data)))
        assert other.key("responses", "mix") != keys.key("responses", "mix")
        assert other.key("prompts", "mix") == keys.key("prompts", "mix")
    finally:
        server.stop()


def _mode(body: dict) -> bool:
    return body.get("chat_template_kwargs", {}).get(
        "thinking", body.get("reasoning", {}).get("enabled", True)
    )


def test_thinking_without_the_targets_switch_is_one_line(project):
    from ...conftest import tiny_params

    data = tiny_params()
    data["datasets"]["sg"]["thinking"] = False
    path = write_params(project, data)
    with pytest.raises(
        Exception, match=r"datasets.sg.thinking: False needs target.thinking_switch"
    ):
        load(path)
