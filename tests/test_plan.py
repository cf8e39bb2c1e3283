"""The production example (the user's datasets and budgets), the drafter it implies for
Kimi-K2.5 against the published AQ-MedAI/Kimi-K25-eagle3 config, and `eaglet plan` on it."""

from __future__ import annotations

import json
import math

import pytest

from eaglet import arch, export, plan
from eaglet.cli import main
from eaglet.drafter import DrafterConfig
from eaglet.params import load
from eaglet.target import text_config

from .conftest import ROOT

EXAMPLE = ROOT / "examples" / "kimi-k2.5.params.yaml"
CONFIG = ROOT / "examples" / "kimi-k2.5.config.json"
USER_DATASETS = [
    "B2_opencodeinstruct",
    "B3_ultrachat",
    "B4_sharegpt",
    "B5_lima",
    "B6_evol_instruct",
    "B7_dolly",
    "B8_self_instruct",
    "A1_deepswekimi",
]
# AQ-MedAI/Kimi-K25-eagle3 config.json, as the notes give it (kimi-k2.5-at-scale.md §2)
AQ_MEDAI = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "intermediate_size": 18432,
    "num_hidden_layers": 1,
    "vocab_size": 163840,
    "draft_vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "rope_scaling": None,
    "max_position_embeddings": 262144,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
}


def kimi_drafter(params, overrides: dict | None = None) -> DrafterConfig:
    text, _ = text_config(json.loads(CONFIG.read_text()))
    d = params.drafter("kimi_k25_eagle3")
    a = d["arch"] | (overrides or {})
    return DrafterConfig.from_target(text, d["draft_vocab_size"], [1, 29, 57], a)


def test_the_example_is_the_users():
    params = load(EXAMPLE)
    assert params.datasets == USER_DATASETS
    assert params.drafter("kimi_k25_eagle3")["datasets"] == USER_DATASETS
    b2 = params.dataset("B2_opencodeinstruct")
    assert (b2["max_samples"], b2["token_budget"]) == (7000, 25_000_000)
    kinds = {ds: params.backend(params.generation(ds)["backend"])["kind"] for ds in USER_DATASETS}
    assert kinds.pop("A1_deepswekimi") == "sglang" and set(kinds.values()) == {"openai"}
    assert params.backend("openrouter")["base_url"].startswith("https://openrouter.ai/")
    assert params.max_length("A1_deepswekimi") == 32768 > params.max_length("B7_dolly")
    assert params.drafter("kimi_k25_eagle3")["draft_vocab_size"] == 32000


def test_the_sglang_export_config_against_the_published_kimi_drafter():
    """Field by field: the same shape; RoPE and eps differ by default (the target's), and
    the published choices are one `arch` away."""
    params = load(EXAMPLE)
    ours = export.sglang_config(kimi_drafter(params))
    same = [k for k in AQ_MEDAI if k not in ("rms_norm_eps", "rope_theta", "rope_scaling")]
    assert {k: ours[k] for k in same} | {"eagle_config": AQ_MEDAI["eagle_config"]} == {
        k: AQ_MEDAI[k] for k in same
    }
    # SGLang ids [1, 29, 57] = vLLM ids [2, 30, 58]: the published list is in vLLM's convention
    assert ours["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert (ours["rms_norm_eps"], ours["rope_theta"]) == (1e-5, 50000.0)
    assert ours["rope_scaling"]["rope_type"] == "yarn" and ours["rope_scaling"]["factor"] == 64.0
    aq = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None}
    published = export.sglang_config(kimi_drafter(params, aq))
    assert all(published[k] == AQ_MEDAI[k] for k in AQ_MEDAI if k != "eagle_config")
    text, _ = text_config(json.loads(CONFIG.read_text()))
    resolved = arch.resolve(text, aq, "config.json")
    assert set(arch.differs(text, resolved)) == {
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
    }


def test_plan_of_the_example(capsys):
    params = load(EXAMPLE)
    report = plan.plan(params, CONFIG)
    per_token = 4 * 7168 * 2 * plan.STORAGE_RATIO[("fp8", True, "zstd")]  # 57 KB bf16 x ratio
    assert report["storage"]["bytes_per_token"] == round(per_token)
    rows = {r["dataset"]: r for r in report["datasets"]}
    b2 = rows["B2_opencodeinstruct"]
    answered = 25_000_000 / 3700  # the token budget stops B2 before its 7,000 prompts
    assert b2["prompts"] == 7000 and b2["completion_tokens"]["expected"] == pytest.approx(25e6)
    assert b2["completion_tokens"]["max"] == 25_000_000  # 7,000 x 8,192 capped by the budget
    want = (25e6 * 2.50 + answered * 300 * 0.60) / 1e6
    assert b2["cost_usd"]["expected"] == pytest.approx(want)
    assert b2["hidden_tokens"]["expected"] == pytest.approx(answered * 4000)
    assert b2["hidden_bytes"]["expected"] == pytest.approx(answered * 4000 * per_token)
    a1 = rows["A1_deepswekimi"]
    assert a1["cost_usd"] == {"expected": 0.0, "max": 0.0}  # the user's own GPUs
    assert a1["hidden_tokens"] == {"expected": 3000 * 16000, "max": 3000 * 32768}
    total = report["total"]
    assert total["prompts"] == sum(r["prompts"] for r in rows.values())
    assert total["cost_usd"]["max"] == 250  # the project's budget.max_cost_usd
    hidden_max = sum(r["hidden_bytes"]["max"] for r in rows.values())
    assert math.isclose(total["hidden_bytes"]["max"], hidden_max)
    assert report["disk"]["fits"]["max"] is (hidden_max <= report["disk"]["free_bytes"])
    args = ["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| A1_deepswekimi | sglang | 3,000 | 32,768 |" in out and "| total |" in out


def test_plan_without_a_readable_target_config_is_one_error(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    assert main(["plan", "--params", str(EXAMPLE), "--target-config", str(bad)]) == 2
    assert "text_config.num_hidden_layers: missing" in capsys.readouterr().err


def test_plan_per_hidden_mode(capsys):
    """Online keeps 5 B/token of ids and prefills every epoch; offline and hybrid store states
    and prefill once."""
    params = load(EXAMPLE)
    report = plan.plan(params, CONFIG)
    tokens = report["total"]["hidden_tokens"]["expected"]
    states = report["total"]["hidden_bytes"]["expected"]
    epochs = params.drafter("kimi_k25_eagle3")["train"]["epochs"]
    modes = {r["mode"]: r for r in report["hidden_modes"]}
    assert modes["online"]["disk_bytes"] == pytest.approx(tokens * 5)
    assert modes["online"]["prefill_tokens_total"] == pytest.approx(tokens * epochs)
    for mode in ("offline", "hybrid"):
        assert modes[mode]["disk_bytes"] == pytest.approx(states + tokens * 5)
        assert modes[mode]["prefill_tokens_total"] == pytest.approx(tokens)
    assert all(r["prefill_tokens_per_epoch"] == pytest.approx(tokens) for r in modes.values())
    main(["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG)])
    assert "repeated every epoch: tokens x epochs" in capsys.readouterr().out


def test_training_memory_of_the_example(capsys):
    """Per dataset: the training peak per GPU at its max_length; A1's 32,768 tokens fit in
    80 GiB; the fixed part's weights are the drafter's own parameter count."""
    import torch

    from eaglet import train_memory
    from eaglet.drafter import Drafter

    params = load(EXAMPLE)
    rows = {r["dataset"]: r for r in plan.plan(params, CONFIG)["training"]}
    a1, b2 = rows["A1_deepswekimi"], rows["B2_opencodeinstruct"]
    assert (a1["tokens"], b2["tokens"], a1["dtype"]) == (32768, 8192, "bfloat16")
    assert a1["fits"] and a1["peak_bytes"] < 80 * 2**30 and a1["longest_that_fits"] > 32768
    assert b2["peak_bytes"] < a1["peak_bytes"]
    with torch.device("meta"):  # the real module, allocated nowhere
        model = Drafter(kimi_drafter(params))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert a1["fixed_bytes"]["weights (fp32)"] == 4 * trained
    assert a1["fixed_bytes"]["frozen embeddings (fp32)"] == 4 * model.embed_tokens.weight.numel()
    small_vocab = train_memory.Shape.of(kimi_drafter(params).to_dict(), 7168, 163840, 4096, 7)
    assert train_memory.estimate(small_vocab, 0)["per_token"] == a1["per_token_bytes"]
    args = ["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG)]
    assert main([*args, "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("train kimi_k25_eagle3 on A1"))
    assert "32,768 tokens" in line and "DOES NOT FIT" in line
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "on A1_deepswekimi" in x)
    assert line.endswith("tokens)") and ": fits (" in line
