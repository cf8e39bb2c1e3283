"""The mission's target as it ships, in miniature (tests/kimi_fixture.py): its own tokenizer
class (trusted explicitly), its template with reasoning and tools, the hub's checkpoint layout
(`kimi_k25` wrapper, one tensor per routed expert, `language_model.` prefix), through the chain
on CPU; and the errors a target eaglet cannot read gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from eaglet.cli import main
from eaglet.errors import EagletError
from eaglet.formats.hidden_store import HiddenReader
from eaglet.formats.io import read_json
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.model import arch
from eaglet.model.target import (
    SMOLLM2,
    check_special_tokens,
    load_config,
    load_head,
    load_model,
    load_tokenizer,
    resolve,
)
from eaglet.params import load

from ..conftest import ROOT, write_params
from ..kimi_fixture import PREFIX, SPECIAL, TEXT, THINK, VOCAB, WRAPPER, operator_engine, tiny_kimi

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
CALL_A = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
}
CALL_B = CALL_A | {
    "id": "functions.get_weather:1",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# an A1-style trajectory: tools, a call, its result, and the turn the target answers with a call
AGENT = {
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What's the weather in Lyon?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_A]},
        {"role": "tool", "tool_call_id": CALL_A["id"], "content": '{"sky": "cloudy"}'},
        {"role": "user", "content": "And in Paris?"},
    ],
}
REASONING = {"messages": [{"role": "user", "content": "Why is the sky blue?"}]}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target")


@pytest.fixture(scope="module")
def tok(kimi):
    return load_tokenizer(resolve(str(kimi), trust=True))


def test_the_miniature_ships_like_kimi(kimi, tok):
    """Router and MLA fields, one tensor per expert, and the tokenizer only its class builds."""
    config = json.loads((kimi / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "kimi_k25" and "hidden_size" not in config
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (512, 64)
    assert text["rope_scaling"]["type"] == "yarn"
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    experts = [n for n in index if ".mlp.experts." in n]
    assert len(experts) == 3 * TEXT["n_routed_experts"] * 7  # layers 1..7 are MoE
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in index)
    assert all(n.startswith(PREFIX) or n.startswith("vision_tower.") for n in index)
    assert PREFIX + "model.layers.1.mlp.gate.e_score_correction_bias" in index
    assert not (kimi / "tokenizer.json").exists()

    assert type(tok).__name__ == "TikTokenTokenizer" and len(tok) == VOCAB
    for k, name in SPECIAL.items():
        assert tok.encode(name, add_special_tokens=False) == [512 + k]
    assert tok.encode("<think>blue</think>", add_special_tokens=False)[0] == THINK

    spec = resolve(str(kimi), trust=True)
    model = load_model(spec, "cpu", "float32")  # per-expert tensors fused by transformers
    from safetensors import safe_open

    name = PREFIX + "model.layers.3.mlp.experts.2.up_proj.weight"
    with safe_open(kimi / index[name], "pt") as f:
        up = f.get_tensor(name)
    fused = model.model.layers[3].mlp.experts.gate_up_proj[2]
    assert torch.equal(fused[TEXT["moe_intermediate_size"] :], up)
    bias = model.model.layers[3].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0  # the router's own bias, loaded, not the zero init


def test_repository_code_needs_explicit_trust(kimi):
    with pytest.raises(EagletError, match=r"auto_map .*target\.trust_remote_code: true"):
        load_tokenizer(resolve(str(kimi)))
    with pytest.raises(EagletError, match=r"target\.trust_remote_code"):
        load_config(resolve(str(kimi)))
    # a hub id runs reviewed code only: a pinned commit, never a moving ref
    with pytest.raises(EagletError, match=r"target\.revision: .* pin the reviewed commit"):
        resolve("moonshotai/Kimi-K2.5", "main", trust=True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    hub = resolve("moonshotai/Kimi-K2.5", commit, trust=True)
    assert hub.identity() == {
        "model": "moonshotai/Kimi-K2.5",
        "revision": commit,
        "trust_remote_code": True,
    }
    plain = resolve("moonshotai/Kimi-K2.5", commit).identity()
    assert plain == {"model": "moonshotai/Kimi-K2.5", "revision": commit}  # keys as before


def test_a_tokenizer_that_splits_the_targets_special_tokens_is_an_error(kimi):
    """A generic tokenizer reads `[BOS]`, `<think>` ... as several ids: the check names one."""
    generic = load_tokenizer(resolve(SMOLLM2))
    with pytest.raises(EagletError, match=r"special token '\[BOS\]' encodes to \[\d+, \d+"):
        check_special_tokens(resolve(str(kimi), trust=True), generic)


def _oracle(tok, rec):
    """The prompt as the template renders it with the generation prompt, then the record's
    generated tokens: ids, and the mask on the generated ones."""
    kw = {"tools": rec["tools"]} if rec.get("tools") else {}
    prompt = tok.apply_chat_template(
        rec["messages"], add_generation_prompt=True, tokenize=False, **kw
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    return ids + rec["output_ids"], [False] * len(ids) + [True] * len(rec["output_ids"])


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["text_config"].pop("hidden_size"), "config.json: text_config.hidden_size"),
        (lambda c: c["text_config"].update(model_type="nope"), "text_config.model_type: 'nope'"),
        (
            lambda c: (
                c["text_config"].pop("qk_nope_head_dim") and c["text_config"].pop("v_head_dim")
            ),
            "text_config.v_head_dim: missing",
        ),
    ],
)
def test_a_size_that_cannot_be_determined_is_one_error(kimi, tmp_path, edit, message):
    broken = tmp_path / "broken"
    shutil.copytree(kimi, broken)
    config = WRAPPER | {"text_config": dict(TEXT)}
    edit(config)
    (broken / "config.json").write_text(json.dumps(config))
    spec = resolve(str(broken), trust=True)
    with pytest.raises(EagletError, match=message):
        load_config(spec)
        load_head(spec)
        from eaglet.model.target import read_config, text_config

        text, prefix = text_config(read_config(spec)[0])
        arch.resolve(text, {}, "config.json", prefix)


def test_head_and_arch_of_the_wrapper(kimi):
    spec = resolve(str(kimi), trust=True)
    cfg = load_config(spec)
    assert type(cfg).__name__ == "DeepseekV3Config" and cfg.hidden_size == 64
    assert cfg.head_dim == TEXT["qk_rope_head_dim"]  # transformers' MLA head_dim: not to copy
    embed, lm_head = load_head(spec)
    assert embed.shape == lm_head.shape == (VOCAB, 64) and not torch.equal(embed, lm_head)
    a = arch.resolve(TEXT, {}, "config.json", "text_config.")
    assert (a["num_attention_heads"], a["head_dim"], a["num_key_value_heads"]) == (2, 32, 2)
    assert a["rope_scaling"]["rope_type"] == "yarn" and a["rope_scaling"]["factor"] == 16.0


def _project(project, kimi, trust: bool) -> list[str]:
    shutil.copytree(kimi, project / "target", dirs_exist_ok=True)
    rows = [AGENT, REASONING]
    (project / "a1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {
        "target": {"model": "target", "max_length": 512, "trust_remote_code": trust},
        "backends": {"local": {"kind": "transformers", "dtype": "float32", "threads": 2}},
        "generation": {"backend": "local", "max_new_tokens": 6, "truncated": "keep"},
        "datasets": {"a1": {"path": "a1.jsonl", "format": "auto"}},
        "hidden": {"compute_dtype": "float32", "dtype": "float32", "threads": 2},
        "drafters": {
            "k": {
                "datasets": ["a1"],
                "draft_vocab_size": 32,
                "heldout_fraction": 0.01,
                "train": {"ttt_length": 1, "epochs": 1, "batch_size": 1},
            }
        },
    }
    return ["--params", str(write_params(project, data))]


def test_trust_off_stops_before_anything_is_written(kimi, project, capsys):
    args = _project(project, kimi, trust=False)
    assert main(["prompts", "a1", *args]) == 0  # no tokenizer needed yet
    keys = Keys(load(args[1]))
    for stage in ("generate", "hidden"):
        assert main([stage, "a1", "--quiet", *args]) == 2
        assert "set target.trust_remote_code: true" in capsys.readouterr().err
        assert not keys.path("responses" if stage == "generate" else "hidden", "a1").exists()


def test_trust_on_the_chain_keeps_the_targets_ids(kimi, project, capsys):
    """prompts (tools kept), generate, hidden: `<think>` is one id in the stored samples."""
    args = _project(project, kimi, trust=True)
    for stage in ("prompts", "generate", "hidden"):
        assert main([stage, "a1", *args] + (["--quiet"] if stage != "prompts" else [])) == 0
    keys = Keys(load(args[1]))
    assert keys.provenance("hidden", "a1")["params"]["target"]["trust_remote_code"] is True
    reader = HiddenReader(keys.path("hidden", "a1"))
    tok = load_tokenizer(resolve(str(project / "target"), trust=True))
    from eaglet.formats.io import read_jsonl

    responses = {r["id"]: r for r in read_jsonl(keys.path("responses", "a1"))}
    tools = [r for r in responses.values() if r.get("tools")]  # a record per turn
    assert [r["id"].split("/")[1] for r in tools] == ["1", "2"] and tools[0]["tools"] == TOOLS
    assert len(reader.ids) == len(responses)  # a recorded trajectory: a sample per turn
    for sid in reader.ids:
        s = reader.get(sid)
        rec = responses[sid] if sid in responses else responses[f"{sid}/1"]
        kw = {"tools": rec["tools"]} if rec.get("tools") else {}
        text = tok.apply_chat_template(
            rec["messages"], add_generation_prompt=True, tokenize=False, **kw
        )
        prompt = tok.encode(text, add_special_tokens=False)
        assert s["input_ids"].tolist() == prompt + rec["output_ids"]
        assert s["loss_mask"].tolist() == [False] * len(prompt) + [True] * len(rec["output_ids"])
    sample = reader.get(tools[0]["id"].split("/")[0])
    prompt = sample["input_ids"][~sample["loss_mask"]].tolist()  # K2.5's, in thinking mode:
    assert prompt[-1] == THINK and prompt.count(THINK) == prompt.count(THINK + 1) + 1  # open

    # the target's own (greedy) answers: training supervises their positions
    assert main(["vocab", "k", *args]) == 0 and main(["train", "k", "--quiet", *args]) == 0
    share = read_json(sidecar_of(keys.path("train", "k")))["stats"]["supervised_share"]["a1"]
    assert share["share"] >= 0.9 and share["samples"] == len(reader.ids)
    assert main(["status", *args]) == 0
    assert f"supervised a1 {share['share']:.2f}" in capsys.readouterr().out


def test_training_on_answers_that_are_not_the_targets_stops_naming_the_dataset(
    kimi, project, capsys
):
    """Answers written elsewhere (an API's text, not this target's): the target does not
    predict them, the supervised share is low, and the train stage stops before training."""
    args = _project(project, kimi, trust=True)
    assert main(["prompts", "a1", *args]) == 0
    keys = Keys(load(args[1]))
    _responses(keys)
    for cmd in (["hidden", "a1", "--quiet"], ["vocab", "k"]):
        assert main([*cmd, *args]) == 0
    capsys.readouterr()
    assert main(["train", "k", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert "dataset 'a1'" in err and "below train.min_supervised_share 0.5" in err
    assert not keys.path("train", "k").exists()


@pytest.mark.slow
def test_whole_chain_on_the_miniature(kimi, project):
    """prompts, responses, hidden, vocab, train, evaluate, both exports (validated) on CPU."""
    shutil.copytree(kimi, project / "target")
    ds = {"format": "sharegpt", "path": "data/demo/sharegpt.jsonl", "max_samples": 8}
    data = {
        "target": {
            "model": "target",
            "max_length": 256,
            "trust_remote_code": True,
            "thinking_switch": "thinking",
        },
        "backends": {"local": {"kind": "transformers", "dtype": "float32", "threads": 2}},
        # K2.5 served both ways: half the prompts answered thinking, half instant
        "generation": {
            "backend": "local",
            "max_new_tokens": 10,
            "truncated": "keep",
            "thinking": "mix",
        },
        "datasets": {
            "sg": ds | {"max_length": 96},
            "dolly": {"path": "data/demo/dolly.jsonl", "format": "dolly", "max_samples": 4},
        },
        "hidden": {"compute_dtype": "float32", "threads": 2},
        "drafters": {
            "k": {
                "datasets": ["sg", "dolly"],
                "draft_vocab_size": 64,
                "heldout_fraction": 0.25,
                "train": {"ttt_length": 2, "epochs": 1, "batch_size": 2, "lr": 1e-3},
                "evaluate": {
                    "num_steps": [2],
                    "prompts": 2,
                    "max_new_tokens": 6,
                    "suites": {"natural": {"path": "natural.jsonl"}},
                    "modes": ["thinking", "instant"],
                },
            }
        },
    }
    shutil.copy(ROOT / "data" / "heldout" / "natural.jsonl", project / "natural.jsonl")
    path = write_params(project, data)
    args = ["--params", str(path)]
    for stage in ("prompts", "generate", "hidden"):
        for name in ("sg", "dolly"):
            assert main([stage, name, *args] + (["--quiet"] if stage != "prompts" else [])) == 0
    for cmd in (["vocab", "k"], ["train", "k", "--quiet"], ["evaluate", "k", "--quiet"]):
        assert main([*cmd, *args]) == 0
    for fmt in ("sglang", "vllm"):
        assert main(["export", "k", "--to", fmt, *args]) == 0

    keys = Keys(load(path))
    sg = HiddenReader(keys.path("hidden", "sg")).manifest
    assert sg["target"]["hidden_size"] == 64 and sg["target"]["num_hidden_layers"] == 8
    assert sg["aux_layer_ids"]["sglang"] == [1, 3, 4] and sg["max_length"] == 96
    train = read_json(sidecar_of(keys.path("train", "k")))["stats"]
    assert set(train["supervised_share"]) == {"sg", "dolly"}
    assert all(s["share"] >= 0.5 for s in train["supervised_share"].values())
    sgl = read_json(keys.path("sglang", "k") / "config.json")
    assert sgl["architectures"] == ["LlamaForCausalLMEagle3"] and sgl["num_hidden_layers"] == 1
    assert sgl["head_dim"] == TEXT["qk_nope_head_dim"] == TEXT["v_head_dim"]
    assert sgl["vocab_size"] == VOCAB and sgl["draft_vocab_size"] == 64
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    vllm = read_json(keys.path("vllm", "k") / "config.json")
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    verifier = vllm["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]
    for fmt in ("sglang", "vllm"):
        report = read_json(sidecar_of(keys.path(fmt, "k")))["stats"]
        assert report["max_abs_diff"] <= 1e-4
    stats = read_json(sidecar_of(keys.path("evaluate", "k")))["stats"]
    # each suite measured in each mode: both greedy-equal to the target alone
    assert set(stats["suites"]) == {"natural/thinking", "natural/instant"}
    for suite in stats["suites"].values():
        assert suite["greedy_equal"]["num_steps_2"] is True
    assert stats["acceptance_length"] >= 1.0
    answered = read_json(sidecar_of(keys.path("responses", "sg")))["stats"]
    modes = answered["modes"]
    assert modes["thinking"] + modes["instant"] == answered["responses"]
    assert min(modes.values()) > 0  # the mix holds both


def test_params_file_of_the_example_trusts_a_pinned_revision():
    example = yaml.safe_load((ROOT / "examples" / "kimi-k2.5.params.yaml").read_text())
    assert example["target"]["trust_remote_code"] is True
    assert len(example["target"]["revision"]) == 40


def _responses(keys) -> list[dict]:
    """Answers as an API writes them (text, reasoning, tool calls; no ids), written in Kimi's
    grammar as the responses stage does."""
    from eaglet.formats.grammar import grammar
    from eaglet.formats.io import read_jsonl, write_jsonl_zst
    from eaglet.formats.records import response_record
    from eaglet.formats.stream import Writer

    writer = Writer(load_tokenizer(keys.target), grammar("kimi_k2"))
    records = []
    for p in read_jsonl(keys.path("prompts", "a1")):
        agent = bool(p.get("tools"))
        result = {
            "response": "" if agent else "Rayleigh scattering.",
            "reasoning": "Ask for Paris too." if agent else "Short waves scatter more.",
            "tool_calls": [CALL_B] if agent else None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "finish_reason": "stop",
            "model": "target",
            "latency_s": 0.0,
        }
        rec = response_record(p, result, "api", {})
        rec["output_ids"] = writer.output_ids(rec)
        records.append(rec)
    write_jsonl_zst(keys.path("responses", "a1"), records)
    return records


@pytest.mark.engine
def test_vllm_states_equal_the_transformers_backend_on_the_miniature(kimi, project):
    """vLLM serves the `kimi_k25` wrapper (its own tokenizer class trusted, language model only)
    and returns every requested layer, the final one (id N) included; ids and masks are the
    template's prompt and the written stream token by token, states equal transformers' in fp32."""
    import subprocess

    args = _project(project, kimi, trust=True)
    assert main(["prompts", "a1", *args]) == 0
    params = load(args[1])
    keys = Keys(params)
    tok = load_tokenizer(resolve(str(project / "target"), trust=True))
    records = _responses(keys)
    ref = HiddenReader(build("hidden", params, "a1", quiet=True))
    data = yaml.safe_load(Path(args[1]).read_text())
    spool = project / "spool"
    spool.mkdir()
    data["hidden"] |= {"backend": "vllm", "spool": str(spool), "concurrency": 2}
    got = HiddenReader(build("hidden", load(write_params(project, data)), "a1", quiet=True))
    assert subprocess.run(["pgrep", "-f", f"--model {project}"]).returncode != 0
    assert not any(spool.iterdir())
    assert got.manifest["last"]["how"].startswith("last layer output from the engine")
    assert got.ids == ref.ids and len(got.ids) == 2
    worst = 0.0
    for rec in records:
        a, b = ref.get(rec["id"]), got.get(rec["id"])
        ids, mask = _oracle(tok, rec)
        assert b["input_ids"].tolist() == ids and b["loss_mask"].tolist() == mask
        assert torch.equal(a["input_ids"], b["input_ids"])
        for name in ("aux", "last"):
            x, y = a[name].flatten(0, -2), b[name].flatten(0, -2)
            worst = max(worst, float(((x - y).norm(dim=-1) / x.norm(dim=-1)).max()))
    assert worst < 1e-3  # fp32, per token relative L2; measured: see docs/targets.md


@pytest.mark.engine
def test_an_engine_that_drops_the_final_layer_is_stopped_by_the_probe(kimi, tmp_path):
    """An operator's engine whose connector drops id N (vLLM before PR #46973 on DeepSeek-family
    models): the hidden stage's probe stops it, naming the vLLM version that captures it."""
    from eaglet.engines.vllm.hidden import VLLMHidden

    spool = tmp_path / "spool"
    spool.mkdir()
    target = resolve(str(kimi), trust=True)
    dropping = ("DropFinalLayer", "tests.old_vllm_connector")
    engine = operator_engine(
        target, spool, tmp_path / "vllm.log", dropping, max_model_len=64, max_num_seqs=1, threads=2
    )
    cfg = {"url": None, "spool": str(spool), "model": "target", "concurrency": 1}
    cfg |= {"timeout_s": 120, "max_retries": 0, "backoff_s": 1.0, "backoff_max_s": 1.0}
    with engine:
        cfg["url"] = engine.url
        with pytest.raises(EagletError, match=r"returned 3 hidden layers .* 0\.32\.0 .*#46973"):
            VLLMHidden(target, cfg, [1, 3, 4], 8, "float32", 64)
