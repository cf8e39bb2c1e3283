"""Format adapters against hand-written fixtures in each dataset's real schema."""

from __future__ import annotations

import json

import pytest

from eaglet.errors import EagletError
from eaglet.formats.datasets import FORMATS, BadRow, detect, prompt_of, to_messages
from eaglet.formats.readers import iter_rows

from ..conftest import DEMO
from ..conftest import FIXTURES as TESTS_FIXTURES

FIXTURES = TESTS_FIXTURES / "formats"


def load(fmt: str) -> list[dict]:
    rows = []
    for line_no, row, error in iter_rows(FIXTURES / f"{fmt}.jsonl"):
        assert error is None, f"{fmt}.jsonl:{line_no}: {error}"
        rows.append(row)
    return rows


def s(text: str) -> dict:
    return {"role": "system", "content": text}


def u(text: str) -> dict:
    return {"role": "user", "content": text}


def a(text: str) -> dict:
    return {"role": "assistant", "content": text}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Rows of each fixture that must be rejected, by 0-based row index, with the exact reason.
BAD = {
    "sharegpt": {
        5: "conversations[2].from: unknown role 'bot'",
        6: "conversations[0].value: expected a string, got null",
        7: "conversations: empty",
    },
    "ultrachat": {
        5: "messages[1].content: expected a string, got number",
        6: "messages[0].content: empty user message",
    },
    "opencodeinstruct": {
        2: "output: missing",
        3: "input: expected a string, got null",
    },
    "dolly": {
        3: "response: missing",
        4: "instruction: empty user message",
    },
    "alpaca": {
        3: "output: expected a string, got null",
        4: "instruction: expected a string, got number",
    },
    "evol_instruct": {
        3: "output: missing",
        4: "conversations[1].from: unknown role 'wizard'",
    },
    "lima": {
        3: "conversations: empty",
        4: "conversations[1]: expected a string, got null",
    },
    "agent": {
        3: "messages[1].tool_calls[0].function.name: missing",
        4: "messages[1].content: expected a string, got null",
        6: "messages[2]: tool result without a pending call",
        7: "messages[1].tool_calls[0].function.arguments: not valid JSON",
    },
}

SPIDER = [
    s("You are a concise assistant. Answer in one sentence."),
    u("How many legs does a spider have?"),
    a("A spider has eight legs."),
    u("And an insect?"),
    a("An insect has six legs."),
]
GAME = [
    u("Can you recommend a board game for four players?"),
    a("Ticket to Ride works well with four players and is easy to learn."),
    u("Something shorter, under thirty minutes?"),
]
WEATHER = [
    s("You can call tools to answer questions."),
    u("What's the weather in Lyon right now?"),
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("call_1_0", "get_weather", '{"city": "Lyon"}')],
    },
    {
        "role": "tool",
        "content": '{"temperature_c": 14, "sky": "cloudy"}',
        "tool_call_id": "call_1_0",
    },
    a("It is 14 °C and cloudy in Lyon."),
]
LEAP = [
    u("Explain what a leap year is."),
    a("A leap year has 366 days; February gets a 29th day."),
    u("Is 2100 a leap year?"),
    a("No. Century years must be divisible by 400, and 2100 is not."),
]
WATER = [
    s("You explain science to children."),
    u("Summarise the water cycle.\nUse at most two sentences."),
    a("Water evaporates, forms clouds and falls back as rain."),
]
RUNNING = [
    u("I want to start running. How often should I run in the first month?"),
    a("Three short runs a week, with rest days in between, is a good start."),
    u("How long should each run be?"),
    a("Twenty minutes, alternating one minute running and one minute walking."),
]
HTTP = [
    u("What does HTTP status 404 mean?"),
    a("404 means the server could not find the requested resource."),
    u("And 503?"),
    a("503 means the service is temporarily unavailable."),
]
SWE_SMITH = [
    s("You are a helpful assistant that can interact with a computer to solve tasks."),
    u(
        "<uploaded_files>\n/testbed\n</uploaded_files>\n"
        "Fix the failing test in tests/test_utils.py."
    ),
    {
        "role": "assistant",
        "content": "Let me look at the test first.",
        "tool_calls": [
            call("toolu_01AbCd", "bash", '{"command": "pytest tests/test_utils.py -x -q"}')
        ],
    },
    {"role": "tool", "content": "1 failed: test_echo_newline", "tool_call_id": "toolu_01AbCd"},
    a("The echo helper drops the trailing newline; I restored the condition."),
]
LIST_DIR = [
    s("Use the tools to answer."),
    u("How many files are in the src directory?"),
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("call_9", "list_dir", '{"path": "src", "recursive": false}')],
    },
    # The legacy function result names no call: it answers the one pending call.
    {
        "role": "tool",
        "content": "main.py\nutils.py\n",
        "tool_call_id": "call_9",
        "name": "list_dir",
    },
]
RENAME = [
    s("You are OpenHands agent."),
    u("Rename the function foo to bar in app.py."),
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            call("call_2_0", "execute_bash", '{"command": "sed -i \'s/foo/bar/\' app.py"}')
        ],
    },
    {"role": "tool", "content": "", "tool_call_id": "call_2_0", "name": "execute_bash"},
    a("Done: foo is now bar."),
]
PARIS_BERLIN = [
    s("You are Kimi. Use the tools when they help."),
    u("Is it warmer in Paris or in Berlin right now?"),
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the weather in both cities; I can ask for both at once.",
        "tool_calls": [
            # double-encoded arguments, decoded once
            call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
            call("functions.get_weather:1", "get_weather", '{"city": "Berlin"}'),
        ],
    },
    {
        "role": "tool",
        "content": '{"temp_c": 12}',
        "tool_call_id": "functions.get_weather:1",
        "name": "get_weather",
    },
    # no tool_call_id: the earliest call still without a result
    {
        "role": "tool",
        "content": '{"temp_c": 18}',
        "tool_call_id": "functions.get_weather:0",
        "name": "get_weather",
    },
    {
        "role": "assistant",
        "content": "Paris is warmer: 18 °C against 12 °C in Berlin.",
        "reasoning_content": "Paris 18 °C, Berlin 12 °C.",
    },
]

# (format, row index, full conversation, prompt_of result)
CASES = [
    (
        "sharegpt",
        0,
        [
            u("What is the capital of Australia?"),
            a("The capital of Australia is Canberra, not Sydney as many people assume."),
        ],
        [u("What is the capital of Australia?")],
    ),
    ("sharegpt", 1, SPIDER, SPIDER[:4]),
    ("sharegpt", 2, GAME, GAME),  # ends with a user turn: the whole conversation is the prompt
    (
        "sharegpt",
        3,  # `items` key, chatgpt role, empty top-level system dropped
        [u("Translate 'good morning' into Spanish."), a("Buenos días.")],
        [u("Translate 'good morning' into Spanish.")],
    ),
    ("sharegpt", 4, WEATHER, WEATHER[:4]),
    (
        "ultrachat",
        0,
        [
            u("What are three benefits of regular walking?"),
            a("Walking improves heart health, lifts mood and helps with sleep."),
        ],
        [u("What are three benefits of regular walking?")],
    ),
    ("ultrachat", 1, LEAP, LEAP[:3]),
    ("ultrachat", 2, WATER, WATER[:2]),
    (
        "ultrachat",
        3,
        [u("Write a limerick about a forgetful robot.")],
        [u("Write a limerick about a forgetful robot.")],
    ),
    (
        "ultrachat",
        4,
        [u("List the planets of the solar system in order.")],
        [u("List the planets of the solar system in order.")],
    ),
    (
        "opencodeinstruct",
        0,
        [
            u(
                "Write a Python function `is_palindrome(s)` that returns True if the string `s` "
                "reads the same forwards and backwards, ignoring case."
            ),
            a("```python\ndef is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n```"),
        ],
        [
            u(
                "Write a Python function `is_palindrome(s)` that returns True if the string `s` "
                "reads the same forwards and backwards, ignoring case."
            )
        ],
    ),
    (
        "opencodeinstruct",
        1,
        [
            u(
                "You are given a list of integers. Return the second largest distinct value, "
                "or None if it does not exist."
            ),
            a(
                "```python\ndef second_largest(nums):\n"
                "    values = sorted(set(nums), reverse=True)\n"
                "    return values[1] if len(values) > 1 else None\n```"
            ),
        ],
        [
            u(
                "You are given a list of integers. Return the second largest distinct value, "
                "or None if it does not exist."
            )
        ],
    ),
    (
        "dolly",
        0,  # empty context
        [
            u("Give me three ideas for a rainy Saturday afternoon."),
            a("Bake bread, start a jigsaw puzzle, or watch an old film."),
        ],
        [u("Give me three ideas for a rainy Saturday afternoon.")],
    ),
    (
        "dolly",
        1,  # context appended after a blank line
        [
            u(
                "How tall is the lighthouse, according to the passage?\n\n"
                "The harbour lighthouse was built in 1872. It stands 34 metres tall "
                "and was automated in 1981."
            ),
            a("The lighthouse is 34 metres tall."),
        ],
        [
            u(
                "How tall is the lighthouse, according to the passage?\n\n"
                "The harbour lighthouse was built in 1872. It stands 34 metres tall "
                "and was automated in 1981."
            )
        ],
    ),
    (
        "dolly",
        2,  # whitespace-only context is treated as empty
        [
            u("Classify each as a fruit or a vegetable: carrot, apple, leek, plum."),
            a("Fruit: apple, plum. Vegetable: carrot, leek."),
        ],
        [u("Classify each as a fruit or a vegetable: carrot, apple, leek, plum.")],
    ),
    (
        "alpaca",
        0,  # empty input
        [
            u("Give three tips for staying focused while studying."),
            a(
                "1. Put your phone in another room.\n2. Work in 25-minute blocks.\n"
                "3. Keep water nearby."
            ),
        ],
        [u("Give three tips for staying focused while studying.")],
    ),
    (
        "alpaca",
        1,
        [
            u("Convert the temperature to Fahrenheit.\n\n25 degrees Celsius"),
            a("25 degrees Celsius is 77 degrees Fahrenheit."),
        ],
        [u("Convert the temperature to Fahrenheit.\n\n25 degrees Celsius")],
    ),
    (
        "alpaca",
        2,  # Self-Instruct prompt/completion
        [
            u("Make a list of four things to pack for a beach day.\n\nOutput:"),
            a(" Sunscreen, a towel, a water bottle and a hat.<|endoftext|>"),
        ],
        [u("Make a list of four things to pack for a beach day.\n\nOutput:")],
    ),
    (
        "evol_instruct",
        0,
        [
            u("Rewrite the sentence in the passive voice: 'The chef cooked a delicious meal.'"),
            a("A delicious meal was cooked by the chef."),
        ],
        [u("Rewrite the sentence in the passive voice: 'The chef cooked a delicious meal.'")],
    ),
    (
        "evol_instruct",
        1,
        [
            u(
                "Explain the difference between a list and a tuple in Python, "
                "with one example each."
            ),
            a("A list is mutable, e.g. [1, 2]; a tuple is immutable, e.g. (1, 2)."),
        ],
        [u("Explain the difference between a list and a tuple in Python, with one example each.")],
    ),
    ("evol_instruct", 2, HTTP, HTTP[:3]),
    (
        "lima",
        0,
        [
            u("Why does bread go stale faster in the fridge?"),
            a(
                "Cold temperatures speed up starch retrogradation, so bread firms up faster "
                "in the fridge than on the counter."
            ),
        ],
        [u("Why does bread go stale faster in the fridge?")],
    ),
    ("lima", 1, RUNNING, RUNNING[:3]),
    (
        "lima",
        2,  # a lone user prompt (LIMA test split)
        [u("Write a short poem about a lighthouse keeper.")],
        [u("Write a short poem about a lighthouse keeper.")],
    ),
    ("agent", 0, SWE_SMITH, SWE_SMITH[:4]),
    ("agent", 1, LIST_DIR, LIST_DIR),  # ends with the tool result
    ("agent", 2, RENAME, RENAME[:4]),
    ("agent", 5, PARIS_BERLIN, PARIS_BERLIN[:5]),
]


def test_every_format_has_a_fixture_with_good_and_bad_rows():
    assert set(BAD) == set(FORMATS)
    for fmt in FORMATS:
        rows = load(fmt)
        assert 1 <= len(BAD[fmt]) < len(rows) - 1, fmt
        assert {case[1] for case in CASES if case[0] == fmt} | set(BAD[fmt]) == set(
            range(len(rows))
        ), f"{fmt}: every fixture row is covered by a case"


@pytest.mark.parametrize(("fmt", "index", "messages", "prompt"), CASES)
def test_messages_and_prompt(fmt, index, messages, prompt):
    row = load(fmt)[index]
    assert detect(row) == fmt
    assert to_messages(row, fmt) == messages
    assert to_messages(row) == messages  # "auto" is the default
    assert prompt_of(to_messages(row, fmt)) == prompt


@pytest.mark.parametrize("fmt", FORMATS)
def test_detect_every_good_row(fmt):
    good = [row for i, row in enumerate(load(fmt)) if i not in BAD[fmt]]
    assert [detect(row) for row in good] == [fmt] * len(good)


@pytest.mark.parametrize(
    ("fmt", "index", "reason"),
    [(fmt, index, reason) for fmt, bad in BAD.items() for index, reason in bad.items()],
)
def test_bad_rows(fmt, index, reason):
    row = load(fmt)[index]
    with pytest.raises(BadRow) as excinfo:
        to_messages(row, fmt)
    assert str(excinfo.value) == reason


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        ({"instruction": "x", "context": "", "response": "y", "category": "open_qa"}, "dolly"),
        ({"instruction": "x", "input": "", "output": "y"}, "alpaca"),
        ({"prompt": "x", "completion": "y"}, "alpaca"),
        ({"instruction": "x", "output": "y"}, "evol_instruct"),
        ({"input": "x", "output": "y", "id": "1", "domain": "generic"}, "opencodeinstruct"),
        ({"prompt": "x", "prompt_id": "1", "messages": []}, "ultrachat"),
        ({"prompt": "x"}, "ultrachat"),
        ({"messages": [{"role": "user", "content": "x"}]}, "ultrachat"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
            "agent",
        ),
        ({"messages": [{"role": "function", "name": "f", "content": "y"}]}, "agent"),
        ({"messages": '[{"role": "tool", "content": "y"}]'}, "agent"),
        ({"trajectory": [{"role": "user", "content": "x"}]}, "agent"),
        ({"conversations": [{"from": "human", "value": "x"}]}, "sharegpt"),
        ({"conversations": []}, "sharegpt"),
        ({"idx": "a1", "conversations": [{"from": "human", "value": "x"}]}, "evol_instruct"),
        ({"conversations": ["x", "y"], "source": "stackexchange"}, "lima"),
    ],
)
def test_detection_order(row, fmt):
    assert detect(row) == fmt


def test_detect_unrecognised_schema_lists_keys():
    with pytest.raises(BadRow) as excinfo:
        detect({"question": "x", "answer": "y"})
    assert str(excinfo.value) == "unrecognised schema, keys: answer, question"


def test_auto_mode_reports_bad_rows_too():
    with pytest.raises(BadRow) as excinfo:
        to_messages({"text": "hello"}, "auto")
    assert str(excinfo.value) == "unrecognised schema, keys: text"
    with pytest.raises(BadRow) as excinfo:
        to_messages(load("sharegpt")[5])
    assert str(excinfo.value) == "conversations[2].from: unknown role 'bot'"


def test_unknown_format_is_a_user_error():
    with pytest.raises(EagletError) as excinfo:
        to_messages({"prompt": "x"}, "openai")
    assert str(excinfo.value) == (
        "unknown format 'openai' (expected auto or one of: sharegpt, ultrachat, "
        "opencodeinstruct, dolly, alpaca, evol_instruct, lima, agent)"
    )


def test_explicit_format_overrides_detection():
    # An evol_instruct-shaped row read as alpaca: `input` is optional there.
    assert to_messages({"instruction": "x", "output": "y"}, "alpaca") == [u("x"), a("y")]
    # A tool-using conversation read as ultrachat is rejected, naming the role.
    row = {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}
    with pytest.raises(BadRow) as excinfo:
        to_messages(row, "ultrachat")
    assert str(excinfo.value) == "messages[1].role: unknown role 'tool'"
    with pytest.raises(BadRow) as excinfo:
        to_messages({"prompt": "x"}, "dolly")
    assert str(excinfo.value) == "instruction: missing"


def test_content_parts():
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
        ]
    }
    assert to_messages(row) == [u("a\nb"), a("c")]
    row["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x"}})
    with pytest.raises(BadRow) as excinfo:
        to_messages(row)
    assert (
        str(excinfo.value) == "messages[0].content[2]: unsupported content part (type 'image_url')"
    )


def test_agent_legacy_function_call_and_non_ascii_arguments():
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "weather", "arguments": {"city": "Zürich"}},
            },
            {"role": "function", "name": "weather", "content": "9 °C"},
            {"role": "assistant", "content": "It is 9 °C."},
        ]
    }
    messages = to_messages(row)
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("call_1_0", "weather", '{"city": "Zürich"}')],
    }
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Zürich"}
    assert messages[2] == {
        "role": "tool",
        "content": "9 °C",
        "tool_call_id": "call_1_0",
        "name": "weather",
    }
    assert prompt_of(messages) == messages[:3]


def test_agent_ai_role_and_text_field():
    # nebius/SWE-agent-trajectories spells the assistant role "ai" and the content "text".
    row = {
        "trajectory": [
            {"role": "system", "text": "You are an agent."},
            {"role": "user", "text": "Fix the bug."},
            {"role": "ai", "text": "Done."},
        ]
    }
    assert to_messages(row) == [s("You are an agent."), u("Fix the bug."), a("Done.")]


def test_agent_messages_as_unparseable_string():
    with pytest.raises(BadRow) as excinfo:
        to_messages({"messages": "[not json"}, "agent")
    assert str(excinfo.value) == "messages: expected a list, got string"


def test_sharegpt_missing_fields():
    with pytest.raises(BadRow) as excinfo:
        to_messages({"conversations": [{"value": "x"}]})
    assert str(excinfo.value) == "conversations[0].from: missing"
    with pytest.raises(BadRow) as excinfo:
        to_messages({"conversations": [{"from": "human"}]})
    assert str(excinfo.value) == "conversations[0].value: missing"
    with pytest.raises(BadRow) as excinfo:
        to_messages({"conversations": [{"from": "function_call", "value": "get_time()"}]})
    assert str(excinfo.value) == "conversations[0].value: function_call is not valid JSON"


def reasoned(text: str, reasoning: str, *calls: dict) -> dict:
    message = {"role": "assistant", "content": text, "reasoning_content": reasoning}
    return {**message, "tool_calls": list(calls)} if calls else message


def result(call_id: str, text: str) -> dict:
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def bad(row: dict, fmt: str = "auto") -> str:
    with pytest.raises(BadRow) as excinfo:
        to_messages(row, fmt)
    return str(excinfo.value)


def test_chat_keeps_reasoning_from_each_spelling():
    row = {
        "messages": [
            {"role": "user", "content": "What is 6 times 7?"},
            {"role": "assistant", "content": "42.", "reasoning_content": "6*7=42."},
            {"role": "user", "content": "And 6 times 8?"},
            {"role": "assistant", "content": "48.", "reasoning": "42+6=48."},
            {"role": "user", "content": "And 6 times 9?"},
            {"role": "assistant", "content": "54.", "thinking": "48+6=54."},
            {"role": "user", "content": "Thanks!"},
            # empty or null reasoning, and a non-string `thinking` (a flag), keep nothing
            {"role": "assistant", "content": "You're welcome.", "reasoning_content": ""},
            {"role": "user", "content": "Bye."},
            {"role": "assistant", "content": "Bye!", "reasoning": None, "thinking": True},
        ]
    }
    expected = [
        u("What is 6 times 7?"),
        reasoned("42.", "6*7=42."),
        u("And 6 times 8?"),
        reasoned("48.", "42+6=48."),
        u("And 6 times 9?"),
        reasoned("54.", "48+6=54."),
        u("Thanks!"),
        a("You're welcome."),
        u("Bye."),
        a("Bye!"),
    ]
    assert detect(row) == "ultrachat"
    assert to_messages(row) == expected
    assert prompt_of(to_messages(row)) == expected[:-1]


def test_agent_keeps_reasoning_of_tool_call_turns():
    row = {
        "trajectory": [
            {"role": "user", "content": "Which branch am I on?"},
            {
                "role": "ai",
                "content": None,
                "thinking": "git can tell me.",
                "tool_calls": [{"function": {"name": "bash", "arguments": {"cmd": "git branch"}}}],
            },
            {"role": "tool", "content": "* main"},
            {"role": "ai", "content": "You are on main.", "reasoning_content": "It printed main."},
        ]
    }
    assert to_messages(row) == [
        u("Which branch am I on?"),
        reasoned("", "git can tell me.", call("call_1_0", "bash", '{"cmd": "git branch"}')),
        result("call_1_0", "* main"),
        reasoned("You are on main.", "It printed main."),
    ]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (
            {"reasoning_content": {"text": "hm"}},
            "messages[1].reasoning_content: expected a string, got object",
        ),
        ({"reasoning": ["step 1"]}, "messages[1].reasoning: expected a string, got list"),
        (
            {"reasoning_content": None, "reasoning": 3},
            "messages[1].reasoning: expected a string, got number",
        ),
    ],
)
def test_chat_rejects_non_string_reasoning(extra, reason):
    row = {"messages": [u("Hi"), {"role": "assistant", "content": "Hello.", **extra}]}
    assert bad(row) == reason


def test_sharegpt_keeps_reasoning_when_a_turn_has_it():
    row = {
        "conversations": [
            {"from": "human", "value": "What's the weather in Oslo?"},
            {
                "from": "function_call",
                "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                "reasoning_content": "Ask the weather tool.",
            },
            {"from": "observation", "value": "-3 °C"},
            {"from": "gpt", "value": "It is -3 °C in Oslo.", "reasoning": "Below zero."},
            {"from": "human", "value": "Thanks."},
            {"from": "gpt", "value": "You're welcome.", "reasoning": ""},
        ]
    }
    assert to_messages(row) == [
        u("What's the weather in Oslo?"),
        reasoned("", "Ask the weather tool.", call("call_1_0", "get_weather", '{"city": "Oslo"}')),
        result("call_1_0", "-3 °C"),
        reasoned("It is -3 °C in Oslo.", "Below zero."),
        u("Thanks."),
        a("You're welcome."),
    ]
    row["conversations"][3]["reasoning"] = {"summary": "Below zero."}
    assert bad(row) == "conversations[3].reasoning: expected a string, got object"


def test_sharegpt_pairs_observations_in_order():
    row = {
        "conversations": [
            {"from": "human", "value": "Weather in Rome and Madrid?"},
            {
                "from": "function_call",
                "value": '[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "get_weather", "arguments": "{\\"city\\": \\"Madrid\\"}"}]',
            },
            {"from": "observation", "value": "21 °C"},
            {"from": "observation", "value": "25 °C"},
            {"from": "gpt", "value": "Rome 21 °C, Madrid 25 °C."},
        ]
    }
    assert to_messages(row) == [
        u("Weather in Rome and Madrid?"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                call("call_1_0", "get_weather", '{"city": "Rome"}'),
                call("call_1_1", "get_weather", '{"city": "Madrid"}'),
            ],
        },
        result("call_1_0", "21 °C"),
        result("call_1_1", "25 °C"),
        a("Rome 21 °C, Madrid 25 °C."),
    ]
    row["conversations"].insert(4, {"from": "observation", "value": "?"})
    assert bad(row) == "conversations[4]: tool result without a pending call"
    # An observation with no function_call before it (once kept unpaired, now rejected).
    row = {"conversations": [{"from": "human", "value": "ls"}, {"from": "tool", "value": "a.txt"}]}
    assert bad(row) == "conversations[1]: tool result without a pending call"


def test_chat_pairs_results_across_assistant_turns():
    row = {
        "messages": [
            u("Check disk and memory, then uptime."),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "t_disk", "function": {"name": "bash", "arguments": '{"cmd": "df"}'}},
                    {"function": {"name": "bash", "arguments": '{"cmd": "free"}'}},
                ],
            },
            {"role": "tool", "content": "disk ok"},
            {
                "role": "assistant",
                "content": "Now uptime.",
                "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "uptime"}'}}],
            },
            {"role": "tool", "content": "up 3 days", "tool_call_id": "call_3_0"},
            {"role": "tool", "content": "mem ok", "tool_call_id": ""},  # empty: paired in order
            a("All fine."),
        ]
    }
    assert to_messages(row, "agent") == [
        u("Check disk and memory, then uptime."),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                call("t_disk", "bash", '{"cmd": "df"}'),
                call("call_1_1", "bash", '{"cmd": "free"}'),
            ],
        },
        result("t_disk", "disk ok"),
        {
            "role": "assistant",
            "content": "Now uptime.",
            "tool_calls": [call("call_3_0", "bash", '{"cmd": "uptime"}')],
        },
        result("call_3_0", "up 3 days"),
        result("call_1_1", "mem ok"),
        a("All fine."),
    ]


def _one_call(call_id: str | None = "c1") -> dict:
    function = {"name": "bash", "arguments": '{"cmd": "ls"}'}
    calls = [{"id": call_id, "function": function}] if call_id else [{"function": function}]
    return {"role": "assistant", "content": "", "tool_calls": calls}


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        (
            [u("ls"), _one_call(), result("c2", "x")],
            "messages[2].tool_call_id: no call with id 'c2'",
        ),
        (  # a later call does not count
            [u("ls"), result("c1", "x"), _one_call()],
            "messages[1].tool_call_id: no call with id 'c1'",
        ),
        (
            [u("ls"), _one_call(), result("c1", "x"), result("c1", "y")],
            "messages[3].tool_call_id: call 'c1' already has a result",
        ),
        (
            [u("ls"), _one_call(), result("c1", "x"), {"role": "tool", "content": "y"}],
            "messages[3]: tool result without a pending call",
        ),
        (
            [u("ls"), {"role": "function", "name": "bash", "content": "x"}],
            "messages[1]: tool result without a pending call",
        ),
        (
            [u("ls"), _one_call(), result("c1", "x"), _one_call()],
            "messages[3].tool_calls[0].id: duplicate call id 'c1'",
        ),
        (  # an explicit id that equals an earlier placeholder
            [u("ls"), _one_call(None), result("call_1_0", "x"), _one_call("call_1_0")],
            "messages[3].tool_calls[0].id: duplicate call id 'call_1_0'",
        ),
    ],
)
def test_chat_rejects_unpaired_results_and_duplicate_ids(messages, reason):
    assert bad({"messages": messages}, "agent") == reason


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"path": "a b", "n": 2}, '{"path": "a b", "n": 2}'),  # a value: dumped
        ('{"path":"a"}', '{"path":"a"}'),  # JSON text: kept as it is
        (json.dumps(json.dumps({"path": "é"})), '{"path": "\\u00e9"}'),  # double: decoded once
        (json.dumps(json.dumps([1, 2])), "[1, 2]"),
        ('"Paris"', '"Paris"'),  # a JSON string that holds no object: kept
        ('"{not json"', '"{not json"'),
        ("null", "null"),
    ],
)
def test_arguments_are_json_text_encoded_once(arguments, text):
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
    }
    messages = to_messages({"messages": [u("go"), turn]}, "agent")
    assert messages[1]["tool_calls"] == [call("call_1_0", "f", text)]


@pytest.mark.parametrize("arguments", ["{'path': 'a'}", "", '{"path": "a"'])
def test_arguments_that_are_not_json(arguments):
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
    }
    assert bad({"messages": [u("go"), turn]}, "agent") == (
        "messages[1].tool_calls[0].function.arguments: not valid JSON"
    )
    value = json.dumps({"name": "f", "arguments": arguments})
    row = {
        "conversations": [
            {"from": "human", "value": "go"},
            {"from": "function_call", "value": value},
        ]
    }
    assert bad(row) == "conversations[1].value[0].function.arguments: not valid JSON"


def test_prompt_of_no_assistant_turn_is_whole_conversation():
    messages = [s("Be brief."), u("Hi"), u("Are you there?")]
    assert prompt_of(messages) == messages


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([], "prompt: empty (nothing before the assistant turn)"),
        ([a("Hello!")], "prompt: empty (nothing before the assistant turn)"),
        ([s("Be brief."), a("Hello!")], "prompt: no user message"),
        ([s("Be brief.")], "prompt: no user message"),
        ([u("Hi"), a("Hello!"), a("Anyone?")], "prompt: ends with an assistant message"),
    ],
)
def test_prompt_of_rejects(messages, reason):
    with pytest.raises(BadRow) as excinfo:
        prompt_of(messages)
    assert str(excinfo.value) == reason


def test_demo_data():
    """data/demo/*: every row parses except one planted bad row; one prompt is shared on purpose."""
    demo = DEMO
    files = {"sharegpt.jsonl": "sharegpt", "dolly.jsonl": "dolly", "alpaca.json": "auto"}
    files["agent.jsonl"] = "agent"
    counts, bad, owners = {}, [], {}
    for name, fmt in files.items():
        counts[name] = 0
        for line_no, row, error in iter_rows(demo / name):
            assert error is None
            try:
                prompt = prompt_of(to_messages(row, fmt))
            except BadRow as e:
                bad.append((name, line_no, str(e)))
                continue
            assert detect(row) == ("alpaca" if fmt == "auto" else fmt)
            counts[name] += 1
            owners.setdefault(json.dumps(prompt, sort_keys=True), []).append(name)
    assert counts == {"sharegpt.jsonl": 23, "dolly.jsonl": 24, "alpaca.json": 24, "agent.jsonl": 12}
    assert bad == [("sharegpt.jsonl", 23, "conversations[1].from: unknown role 'bot'")]
    shared = [names for names in owners.values() if len(names) > 1]
    assert shared == [["sharegpt.jsonl", "dolly.jsonl"]]
