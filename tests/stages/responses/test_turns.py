"""Every assistant turn regenerated, each in the context the target saw when it generated it:
the miniature Kimi-K2.5 (a template that drops earlier reasoning, as K2.5's does) answering
through an OpenRouter-shaped loopback server, in each mode, and a tool trajectory regenerated
from its recorded history."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglet.cli import main
from eaglet.formats.hidden_store import HiddenReader
from eaglet.formats.io import read_json, read_jsonl
from eaglet.formats.store import Store
from eaglet.graph.keys import Keys, resolve_stage
from eaglet.model.target import load_tokenizer, resolve
from eaglet.params import load
from eaglet.stages.responses.run import scan

from ...conftest import write_params
from ...kimi_api import KimiAPI
from ...kimi_fixture import tiny_kimi

KEY_ENV = "EAGLET_TEST_TURNS_KEY"
USERS = ["Name a colour.", "A fruit of that colour?", "And a vegetable?"]
OLD = ["Blue.", "Blueberries.", "None comes to mind."]  # the dataset's answers (another model's)
# what the target emits after each user turn, in each mode (its generation prompt ends `<think>`)
STREAMS = {
    q: {True: f"Pondering {k}.</think>Reply {k}.<|im_end|>", False: f"Reply {k}.<|im_end|>"}
    for k, q in enumerate(USERS)
}
STREAMS |= {
    "Say hi.": {True: "Greeting.</think>Hi.<|im_end|>", False: "Hi.<|im_end|>"},
    "Weather in Lyon?": "Need a tool.</think>Let me check.<|im_end|>",
    "And in Paris?": "Paris now.</think>Paris is sunny.<|im_end|>",
}
CHAT = {
    "messages": [
        m
        for q, a in zip(USERS, OLD, strict=True)
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
}
SINGLE = {"messages": [{"role": "user", "content": "Say hi."}]}
RECORDED = {  # a trajectory with a tool result: the tool answered the recorded call
    "messages": [
        {"role": "user", "content": "Weather in Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
        {"role": "user", "content": "And in Paris?"},
        {"role": "assistant", "content": "Sunny there."},
    ]
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target")


@pytest.fixture(scope="module")
def tok(kimi):
    return load_tokenizer(resolve(str(kimi), trust=True))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt(tok, messages: list[dict], thinking: bool) -> list[int]:
    """The turn's prompt as the target's own tokenizer renders it, generation prompt included."""
    text = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, thinking=thinking
    )
    return ids(tok, text)


def project_params(project, kimi, url: str, datasets: dict) -> list[str]:
    shutil.copytree(kimi, project / "target")
    for name, rows in (("chat", [CHAT, SINGLE]), ("agent", [RECORDED])):
        (project / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {
        "target": {
            "model": "target",
            "max_length": 512,
            "trust_remote_code": True,
            "grammar": "kimi_k2",
            "thinking_switch": "thinking",
        },
        "backends": {
            "api": {
                "kind": "openai",
                "base_url": f"{url}/v1",
                "model": "moonshotai/kimi-k2.5",
                "api_key_env": KEY_ENV,
                "concurrency": 4,
                "reasoning_field": "reasoning",
            }
        },
        "generation": {"backend": "api", "max_new_tokens": 64},
        "datasets": datasets,
        "hidden": {"compute_dtype": "float32", "dtype": "float32", "threads": 2},
    }
    return ["--params", str(write_params(project, data))]


def build(args: list[str], *datasets: str) -> Keys:
    for ds in datasets:
        assert main(["prompts", ds, *args]) == 0
        assert main(["generate", ds, *args, "--quiet"]) == 0
        assert main(["hidden", ds, *args, "--quiet"]) == 0
    return Keys(load(args[1]))


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of True."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_every_turn_is_asked_after_the_targets_own_answers_and_supervised_in_its_context(
    kimi, tok, project, monkeypatch, capsys
):
    """A three-turn conversation: three requests in order, request k holding the target's
    answers 1..k-1 (never the dataset's); three records; three supervised spans, each after
    exactly the tokens the target saw when it generated that turn. Thinking off: K2.5's
    template re-renders each answer as it was emitted, so one sample holds all three turns.
    Thinking on: the template drops earlier reasoning, so each turn is a sample of its own.
    `turns: last` asks once, after the dataset's own history."""
    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, STREAMS).start()
    try:
        chat = {"path": "chat.jsonl", "format": "ultrachat"}
        args = project_params(
            project,
            kimi,
            server.url,
            {
                "off": {**chat, "thinking": False},
                "on": {**chat, "thinking": True},
                "last": {**chat, "thinking": False, "turns": "last"},
            },
        )
        params = load(args[1])
        assert main(["prompts", "off", *args]) == 0
        _, job = resolve_stage("responses", params, "off")
        store = Store(job.store)
        before = scan(job, store)  # the whole run, counted in turns before any is asked
        store.close()
        assert (before["prompts"], before["turns"], before["missing"]) == (2, 4, 4)
        keys = build(args, "off", "on", "last")
        conv = next(p for p in read_jsonl(keys.path("prompts", "off")) if len(p["messages"]) == 5)

        for ds, on in (("off", False), ("on", True)):
            asked = [b for b in server.bodies if _thinking(b) is on]
            turns = [
                b
                for b in asked
                if b["messages"][-1]["content"] in USERS
                and not any(m["content"] in OLD for m in b["messages"])  # not `turns: last`
            ]
            assert [b["messages"][-1]["content"] for b in turns] == USERS  # in order, once each
            for k, body in enumerate(turns):
                want = []
                for j in range(k):  # the user turns, then the target's own answers
                    want.append({"role": "user", "content": USERS[j]})
                    answer = {"role": "assistant", "content": f"Reply {j}."}
                    want.append(answer | ({"reasoning": f"Pondering {j}."} if on else {}))
                assert body["messages"] == [*want, {"role": "user", "content": USERS[k]}]
            recs = [r for r in read_jsonl(keys.path("responses", ds)) if "/" in r["id"]]
            assert [r["id"] for r in recs] == [f"{conv['id']}/{k}" for k in (1, 2, 3)]
            side = read_json(keys.sidecar("responses", ds))["stats"]
            assert (side["conversations"], side["responses"]) == (2, 4)
            assert side["regeneration"]["turns"]["count"] == 4
            reader = HiddenReader(keys.path("hidden", ds))
            contexts = [prompt(tok, r["messages"], on) for r in recs]
            emitted = [ids(tok, STREAMS[u][on]) for u in USERS]
            assert [r["output_ids"] for r in recs] == emitted
            if not on:  # one sample, three spans, each in its own context
                sample = reader.get(conv["id"])
                got, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
                want = [(len(c), len(c) + len(e)) for c, e in zip(contexts, emitted, strict=True)]
                assert spans(mask) == want
                for c, e in zip(contexts, emitted, strict=True):
                    assert got[: len(c)] == c and got[len(c) : len(c) + len(e)] == e
                assert got == contexts[-1] + emitted[-1]
                meta = {m["id"]: m for m in reader.manifest["samples"]}[conv["id"]]
                assert meta["turns"] == 3 and meta["loss_tokens"] == sum(map(len, emitted))
                assert read_json(keys.sidecar("hidden", ds))["stats"]["merged_turns"] == 2
            else:  # reasoning dropped from the history: a sample per turn
                for k, (c, e) in enumerate(zip(contexts, emitted, strict=True)):
                    sid = conv["id"] if k == 0 else f"{conv['id']}/{k + 1}"
                    s = reader.get(sid)
                    assert s["input_ids"].tolist() == c + e
                    assert spans(s["loss_mask"].tolist()) == [(len(c), len(c) + len(e))]
                assert read_json(keys.sidecar("hidden", ds))["stats"].get("merged_turns", 0) == 0

        [rec] = [r for r in read_jsonl(keys.path("responses", "last")) if r["id"] == conv["id"]]
        assert rec["messages"] == conv["messages"]  # the dataset's own history
        assert rec["output_ids"] == ids(tok, STREAMS[USERS[2]][False])
        asked = sum(b["messages"] == conv["messages"] for b in server.bodies)
        assert asked == 1
        assert keys.key("responses", "last") != keys.key("responses", "off")

        capsys.readouterr()
        assert main(["status", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        off = [line for line in lines if line.startswith("off ")]
        assert "4/4 turns of 2 conversations answered" in next(x for x in off if "responses" in x)
        assert "2 seqs (4 turns)" in next(x for x in off if " hidden " in x)

        # the store keys of each turn are stable: another dataset asking the same turns pays
        # for none of them
        paid = len(server.bodies)
        data = load(args[1]).data
        data["datasets"]["again"] = {**chat, "thinking": False}
        build(["--params", str(write_params(project, data))], "again")
        assert len(server.bodies) == paid
    finally:
        server.stop()


TOPICS = [f"Topic {i}?" for i in range(8)]
FOLLOW = ["More?", "And?"]
BUDGETED = {q: {False: f"On {q} a few words.<|im_end|>"} for q in TOPICS} | {
    q: {False: f"Reply to {q} here.<|im_end|>"} for q in FOLLOW
}


def test_a_token_budget_keeps_the_longest_prefix_of_whole_conversations(
    kimi, tok, project, monkeypatch
):
    """Eight three-turn conversations under a token budget that ends inside the third: the
    output is the first two whole (their six turns), no conversation cut in its middle, and
    dispatch asks no turn beyond what the budget lets it see; a rerun asks nothing."""
    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, BUDGETED).start()
    try:
        rows = []
        for q in TOPICS:
            msgs = []
            for u in (q, *FOLLOW):
                msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "Old."}]
            rows.append({"messages": msgs})
        size = {q: len(ids(tok, BUDGETED[q][False])) for q in BUDGETED}
        per = {q: size[q] + sum(size[f] for f in FOLLOW) for q in TOPICS}
        (project / "budget.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        b = {"path": "budget.jsonl", "format": "ultrachat", "thinking": False}
        args = project_params(project, kimi, server.url, {"b": b})
        data = load(args[1]).data
        assert main(["prompts", "b", *args]) == 0
        keys = Keys(load(args[1]))
        order = [p["messages"][0]["content"] for p in read_jsonl(keys.path("prompts", "b"))]
        budget = per[order[0]] + per[order[1]] + per[order[2]] // 2  # ends inside the third
        data["datasets"]["b"]["token_budget"] = budget
        write_params(project, data)
        assert main(["generate", "b", *args, "--quiet"]) == 0
        keys = Keys(load(args[1]))
        recs = list(read_jsonl(keys.path("responses", "b")))
        firsts = [r["messages"][0]["content"] for r in recs]
        assert firsts == [order[0]] * 3 + [order[1]] * 3  # two whole conversations
        side = read_json(keys.sidecar("responses", "b"))["stats"]
        assert (side["conversations"], side["stopped_by"]) == (2, "token_budget")
        assert side["completion_tokens"] == per[order[0]] + per[order[1]] <= budget
        asked = len(server.bodies)
        assert asked < 3 * len(TOPICS)  # the budget stopped dispatch, not only the output
        assert main(["generate", "b", *args, "--quiet"]) == 0
        assert len(server.bodies) == asked  # every answer it needs is in the store
    finally:
        server.stop()


def test_a_tool_trajectory_is_regenerated_turn_by_turn_from_its_recorded_history(
    kimi, tok, project, monkeypatch
):
    """The tools answered the recorded calls, not the target's: each assistant turn is asked
    with the recorded trajectory before it, and is a sample of its own."""
    monkeypatch.setenv(KEY_ENV, "sk-test")
    server = KimiAPI(tok, STREAMS).start()
    try:
        args = project_params(
            project, kimi, server.url, {"a1": {"path": "agent.jsonl", "format": "agent"}}
        )
        keys = build(args, "a1")
        [p] = list(read_jsonl(keys.path("prompts", "a1")))
        assert [b["messages"][-1]["content"] for b in server.bodies] in (
            ["Weather in Lyon?", "And in Paris?"],
            ["And in Paris?", "Weather in Lyon?"],  # independent requests: either order
        )
        recs = list(read_jsonl(keys.path("responses", "a1")))
        assert [r["id"] for r in recs] == [f"{p['id']}/1", f"{p['id']}/2"]
        assert recs[0]["messages"] == p["messages"][:1]
        assert recs[1]["messages"] == p["messages"]  # the recorded call and its result
        reader = HiddenReader(keys.path("hidden", "a1"))
        assert sorted(reader.ids) == sorted([p["id"], f"{p['id']}/2"])
        tools = p.get("tools")
        for sid, rec in zip((p["id"], f"{p['id']}/2"), recs, strict=True):
            text = tok.apply_chat_template(
                rec["messages"], tools=tools, add_generation_prompt=True, tokenize=False
            )
            want = ids(tok, text) + rec["output_ids"]
            assert reader.get(sid)["input_ids"].tolist() == want
    finally:
        server.stop()


def _thinking(body: dict) -> bool:
    return body.get("chat_template_kwargs", {}).get(
        "thinking", body.get("reasoning", {}).get("enabled", True)
    )


def test_the_plan_counts_the_turns_of_the_built_prompts(project):
    """`eaglet plan` asks a request a turn: the built prompts' turns, counted from the raw
    file's user turns (an independent count), under `turns: all`; one a prompt under `last`."""
    from eaglet.reports.plan import plan

    raw = project / "data" / "demo" / "sharegpt.jsonl"
    data = {
        "target": {"model": "smollm2-135m-instruct"},
        "generation": {"max_new_tokens": 10},
        "datasets": {
            "all": {"path": str(raw), "format": "sharegpt"},
            "last": {"path": str(raw), "format": "sharegpt", "turns": "last"},
        },
    }
    params = load(write_params(project, data))
    for ds in ("all", "last"):
        assert main(["prompts", ds, "--params", str(params.path)]) == 0
    keys = Keys(params)
    built = {p["id"] for p in read_jsonl(keys.path("prompts", "all"))}
    users = []
    for line in raw.read_text().splitlines():
        row = json.loads(line)
        roles = [m["from"] for m in row["conversations"]]
        if "bot" in roles or "human" not in roles:
            continue  # the rows the prompts stage refuses or cannot cut
        if roles[-1] == "gpt":  # cut before the last answer: the turn the dataset answered
            roles = roles[:-1]
        users.append(roles.count("human"))  # a regenerated turn answers each user turn
    assert len(users) == len(built) and max(users) > 1
    rows = {r["dataset"]: r for r in plan(params, free_disk=1e12)["datasets"]}
    n = len(built)
    assert rows["all"]["turns"] == round(sum(users) / n, 3)
    assert rows["all"]["requests"]["max"] == sum(users)
    assert rows["all"]["completion_tokens"]["max"] == sum(users) * 10
    assert (rows["last"]["turns"], rows["last"]["requests"]["max"]) == (1, n)
