"""The production example (the user's datasets and budgets), the drafter it implies for
Kimi-K2.5 against the published AQ-MedAI/Kimi-K25-eagle3 config, and `eaglet plan` on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from eaglet.cli import main
from eaglet.formats import exports
from eaglet.model import arch
from eaglet.model.drafter import DrafterConfig
from eaglet.model.target import text_config
from eaglet.params import load
from eaglet.reports import plan

from ..conftest import ROOT

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
    ours = exports.sglang_config(kimi_drafter(params))
    same = [k for k in AQ_MEDAI if k not in ("rms_norm_eps", "rope_theta", "rope_scaling")]
    assert {k: ours[k] for k in same} | {"eagle_config": AQ_MEDAI["eagle_config"]} == {
        k: AQ_MEDAI[k] for k in same
    }
    # SGLang ids [1, 29, 57] = vLLM ids [2, 30, 58]: the published list is in vLLM's convention
    assert ours["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert (ours["rms_norm_eps"], ours["rope_theta"]) == (1e-5, 50000.0)
    assert ours["rope_scaling"]["rope_type"] == "yarn" and ours["rope_scaling"]["factor"] == 64.0
    aq = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None}
    published = exports.sglang_config(kimi_drafter(params, aq))
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

    from eaglet.model import train_memory
    from eaglet.model.drafter import Drafter

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
    # per token nothing grows with the draft vocab or the TTT depth (the demo's 4,096 and 3)
    small = train_memory.Shape.of(kimi_drafter(params).to_dict(), 7168, 163840, 4096, 3)
    assert train_memory.estimate(small, 0)["per_token"] == a1["per_token_bytes"]
    args = ["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG)]
    assert main([*args, "--gpu-memory", "40"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("train kimi_k25_eagle3 on A1"))
    assert "32,768 tokens" in line and "DOES NOT FIT" in line
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "on A1_deepswekimi" in x)
    assert line.endswith("tokens)") and ": fits (" in line


# ---------------------------------------------------------------------------- the whole run


def test_the_run_stage_by_stage(capsys):
    """One row per stage, placed on the user's node (8 x 96 GB) by arithmetic checked here
    against its inputs; evaluation on the serving engine, never in-process."""
    import torch

    from eaglet.graph import footprint
    from eaglet.model.drafter import Drafter
    from eaglet.reports import placement

    params = load(EXAMPLE)
    report = plan.plan(params, CONFIG)
    rows = {r["stage"]: r for r in report["stages"]["rows"]}
    stages = [f"generate {ds}" for ds in USER_DATASETS] + ["hidden states (all datasets)"]
    stages += [f"{s} kimi_k25_eagle3" for s in ("vocab", "train", "evaluate", "export")]
    assert list(rows) == stages
    # A1 on the local SGLang server across the node: weights / 8, Kimi's MLA latent per token
    a1 = rows["generate A1_deepswekimi"]
    assert "TP 8 on this node" in a1["runs_on"]
    kv_seq = 61 * (512 + 64) * 2 * 32768
    gib = 2**30  # GPU memory in one unit, as the training check counts it
    assert a1["gpu_gb"] == {
        "weights_gib": 554e9 / 8 / gib,
        "kv_gib_per_seq": kv_seq / gib,
        "seqs": 64,
    }
    held = int((0.9 * 96 * gib - 554e9 / 8) // kv_seq)
    assert a1["fits"] == f"fits {held} of 64 in flight" and held == 10
    assert a1["seconds"] == pytest.approx(3000 / 0.35)  # the measured 0.3-0.4 req/s
    b2 = rows["generate B2_opencodeinstruct"]
    assert "openrouter.ai API" in b2["runs_on"] and b2["seconds"] == pytest.approx(25e6 / 16700)
    # training: torchrun x 8, its memory the largest per-dataset peak of eaglet.model.train_memory
    train = rows["train kimi_k25_eagle3"]
    peaks = {r["dataset"]: r["peak_bytes"] for r in report["training"]}
    a1_peak = f"{peaks['A1_deepswekimi'] / 2**30:.1f} GiB at 32,768 tokens (A1_deepswekimi)"
    assert max(peaks, key=peaks.get) == "A1_deepswekimi"
    assert train["runs_on"] == "torchrun x 8" and train["gpu_gb"] == a1_peak
    assert train["fits"] == "fits"
    hidden = sum(r["hidden_tokens"]["expected"] for r in report["datasets"])
    assert train["seconds"] == pytest.approx(3 * 0.9 * hidden / 10000)
    # evaluation: eaglet's vLLM TP 8 serving the target and the drafter, plain + 2 num_steps
    ev = rows["evaluate kimi_k25_eagle3"]
    marked = {r["rate"]: r["source"] for r in report["stages"]["rates"]}
    assert marked["prefill_tokens_per_s"] == marked["train_tokens_per_s"] == "assumed (default)"
    assert marked["rates.sglang.requests_per_s"] == "params"  # the user's, in the file
    runs = "4 suites x 1 modes x 2 temperatures x 2 step counts, 280 prompts a pass"
    assert ev["runs_on"] == f"vLLM TP 8 (eaglet starts, 3 engines); {runs}"
    assert ev["fits"] == "fits"
    cfg, rates = params.drafter("kimi_k25_eagle3")["evaluate"], params.data["plan"]
    assert sum(s.get("prompts", cfg["prompts"]) for s in cfg["suites"].values()) == 280
    one_pass = 280 * cfg["max_new_tokens"] / (rates["decode_tokens_per_s"] * 4)
    # three engine starts; the target alone once, then 2 step counts x 2 temperatures
    assert ev["seconds"] == pytest.approx(3 * rates["engine_startup_s"] + (1 + 2 * 2) * one_pass)
    with torch.device("meta"):
        n = sum(p.numel() for p in Drafter(kimi_drafter(params)).parameters())
    text = json.loads(CONFIG.read_text())["text_config"]
    trained, embed = placement.drafter_parameters(text, arch.resolve(text, {}, "c"), 32000)
    assert trained + embed == n  # the drafter's real module, built on the meta device
    assert ev["gpu_gb"]["weights_gib"] == pytest.approx((554e9 + 2 * n) / 8 / 2**30)
    text = json.loads(CONFIG.read_text())["text_config"]
    assert not footprint.in_process(params.drafter("kimi_k25_eagle3")["evaluate"], text)
    wall = report["stages"]["wall_s"]
    node = sum(r["seconds"] for r in report["stages"]["rows"][8:])
    assert wall == pytest.approx(max(report["stages"]["generation_api_s"], 3000 / 0.35) + node)
    assert main(["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG)]) == 0
    out = capsys.readouterr().out
    assert "| evaluate kimi_k25_eagle3 | vLLM TP 8" in out and "wall clock (expected)" in out


def test_an_evaluation_that_fits_nowhere_is_refused(tmp_path):
    """The example without its engine: the plan says DOES NOT FIT, the keys refuse it."""
    overlay = tmp_path / "no-engine.yaml"
    overlay.write_text(
        f"extends: {EXAMPLE}\ndrafters: {{kimi_k25_eagle3: {{evaluate: {{engine: none}}}}}}\n"
    )
    report = plan.plan(load(overlay), CONFIG)
    ev = report["stages"]["rows"][-2]
    assert ev["fits"] == "DOES NOT FIT" and ev["runs_on"].startswith("nowhere")


def test_in_process_evaluation_only_where_the_target_fits(project, monkeypatch):
    """SmolLM2 fits this machine, so `auto` decodes in-process; on a machine of 100 MB it does
    not, and with no engine the evaluate key refuses (one line) instead of trying."""
    from eaglet.errors import EagletError
    from eaglet.graph import footprint
    from eaglet.graph.keys import Keys
    from eaglet.model.target import materialize, resolve

    from ..conftest import tiny_params, write_params

    folder = materialize(resolve("smollm2-135m-instruct"))
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        names = [k for k in f.keys() if "norm" not in k]  # noqa: SIM118 (not a dict)
        shapes = [f.get_slice(k).get_shape() for k in names]
    counted = sum(math.prod(s) for s in shapes)  # norms aside, as the count leaves them
    text = json.loads((Path(folder) / "config.json").read_text())
    assert footprint.parameters(text) == counted
    params = load(write_params(project, tiny_params()))
    keys = Keys(params)
    assert keys.provenance("evaluate", "d")["params"]["evaluate"]["in_process"] is True
    monkeypatch.setattr(footprint, "memory_here", lambda device: 100_000_000)
    with pytest.raises(EagletError, match="does not fit in this machine's memory in float32"):
        Keys(params).key("evaluate", "d")
    data = tiny_params()
    data["drafters"]["d"]["evaluate"]["engine"] = "vllm"
    engine_only = Keys(load(write_params(project, data)))
    assert engine_only.provenance("evaluate", "d")["params"]["evaluate"]["in_process"] is False


# ------------------------------------------------------- the node's disk, and what fits instead

GIB = 2**30
SPOOL_ONE = 64 * 32768 * 4 * 7168 * 2  # in flight x A1's length x 3 aux + last x H x bf16


def overlay(folder: Path, body: str, name: str = "overlay.yaml", dvc: bool = True) -> Path:
    """The example with `body` on top, in `folder` with the repository's .dvc/config (DVC's
    cache.type is the project's, read from where the params file lies) or none."""
    if dvc:
        (folder / ".dvc").mkdir(parents=True, exist_ok=True)
        (folder / ".dvc" / "config").write_text((ROOT / ".dvc" / "config").read_text())
    path = folder / name
    path.write_text(f"extends: {EXAMPLE}\n{body}")
    return path


def stage_disk(report: dict, kind: str) -> float:
    return sum(r["disk_bytes"] for r in report["stages"]["rows"] if r["stage"].startswith(kind))


def test_the_node_disk_is_the_sum_of_what_it_holds():
    """Weights, states + ids, the spool of the requests in flight, training and exports, each
    from the inputs; the repository's DVC config links, so its cache holds no second copy."""
    free = 5e12
    report = plan.plan(load(EXAMPLE), CONFIG, free_disk=free)
    node = report["node_disk"]
    tokens = report["total"]["hidden_tokens"]["expected"]
    per_token = 4 * 7168 * 2 * plan.STORAGE_RATIO[("fp8", True, "zstd")]  # fp8 + zstd
    assert "hardlink" in (ROOT / ".dvc" / "config").read_text()  # what the plan reads
    want = {
        "target_weights": 554e9,
        "hidden_states": tokens * (per_token + 5),  # shards + int32 ids and a bool mask
        "dvc_cache_copy": 0,
        "hidden_spool": SPOOL_ONE,
        "training_folders": stage_disk(report, "train "),
        "exports": stage_disk(report, "export "),
    }
    assert pytest.approx(120.26e9, rel=1e-3) == SPOOL_ONE  # the ~120 GB of A1 at 32K
    got = {k: v["expected"] for k, v in node["parts"].items()}
    assert got == pytest.approx(want)
    assert node["total"]["expected"] == pytest.approx(sum(want.values()))
    assert node["fits"]["expected"] is (sum(want.values()) <= free) is True
    assert node["options"] == []  # nothing to propose where it fits
    assert node["dvc"]["copies"] is False and node["dvc"]["from"] == ".dvc/config"
    tight = plan.plan(load(EXAMPLE), CONFIG, free_disk=sum(want.values()) * 0.999)
    assert tight["node_disk"]["fits"]["expected"] is False and tight["node_disk"]["options"]


def test_a_dvc_cache_that_copies_counts_a_second_copy(tmp_path):
    """cache.type copy (and DVC's default reflink,copy where no config sets one): what make
    store adds is on the disk twice; the option to link saves exactly that copy."""
    project, bare = tmp_path / "project", tmp_path / "bare"
    (project / ".dvc").mkdir(parents=True)
    (project / ".dvc" / "config").write_text(
        "[core]\n    autostage = true\n[cache]\n    type = copy\n"
    )
    report = plan.plan(load(overlay(project, "", dvc=False)), CONFIG, free_disk=1e12)
    node = report["node_disk"]
    stored = node["parts"]["hidden_states"]["expected"]
    stored += stage_disk(report, "train ") + stage_disk(report, "export ")
    assert node["dvc"]["copies"] is True and node["parts"]["dvc_cache_copy"]["expected"] == stored
    link = next(o for o in node["options"] if o["option"] == "dvc_link")
    assert link["saves_bytes"] == pytest.approx(stored)
    assert link["total_bytes"] == pytest.approx(node["total"]["expected"] - stored)
    bare.mkdir()
    default = plan.plan(load(overlay(bare, "", dvc=False)), CONFIG, free_disk=1e12)
    default = default["node_disk"]["dvc"]
    assert (default["type"], default["copies"]) == ("reflink,copy", True)


def test_fewer_samples_of_the_largest_dataset_make_the_disk_fit(tmp_path):
    """The proposed max_samples of A1 (the largest states), planned again with that count,
    fits the same free disk; one sample more does not."""
    free = 4e12
    report = plan.plan(load(EXAMPLE), CONFIG, free_disk=free)
    node = report["node_disk"]
    assert node["fits"]["expected"] is False
    sizes = {r["dataset"]: r["hidden_bytes"]["expected"] for r in report["datasets"]}
    options = {o["option"]: o for o in node["options"]}
    fewer = options["fewer_samples"]
    assert fewer["dataset"] == max(sizes, key=sizes.get) == "A1_deepswekimi"
    n = fewer["max_samples"]
    assert fewer["fits"] and 0 < n < 3000

    def total_at(samples: int) -> dict:
        body = f"datasets: {{A1_deepswekimi: {{max_samples: {samples}}}}}\n"
        p = overlay(tmp_path, body, f"a1-{samples}.yaml")
        return plan.plan(load(p), CONFIG, free_disk=free)["node_disk"]

    assert total_at(n)["fits"]["expected"] is True
    assert total_at(n)["total"]["expected"] == pytest.approx(fewer["total_bytes"])
    assert total_at(n + 1)["fits"]["expected"] is False
    # a second disk takes the states and the spool; online keeps the ids only
    second = options["second_disk"]
    moved = node["parts"]["hidden_states"]["expected"] + SPOOL_ONE
    assert second["needs_bytes"] == pytest.approx(moved)
    assert second["total_bytes"] == pytest.approx(node["total"]["expected"] - moved)
    online = next(r for r in report["hidden_modes"] if r["mode"] == "online")
    assert options["online"]["total_bytes"] == pytest.approx(online["node_disk_bytes"])
    assert options["online"]["fits"] is False  # its disk would, its GPUs do not (below)
    assert "storage" not in options and "dvc_link" not in options  # fp8 + zstd, linked


def test_a_cheaper_storage_is_priced_by_planning_it(tmp_path):
    """Without FP8, the option 'hidden.fp8: true' totals what the plan with FP8 totals."""
    free = 4e12
    bf16 = plan.plan(load(overlay(tmp_path, "hidden: {fp8: false}\n")), CONFIG, free_disk=free)
    fp8 = next(o for o in bf16["node_disk"]["options"] if o["change"] == "hidden.fp8: true")
    again = plan.plan(load(EXAMPLE), CONFIG, free_disk=free)["node_disk"]["total"]["expected"]
    assert fp8["total_bytes"] == pytest.approx(again)
    assert fp8["saves_bytes"] == pytest.approx(bf16["node_disk"]["total"]["expected"] - again)


def test_online_shares_each_gpu_between_engine_and_trainer(capsys):
    """Online and hybrid: the engine's weights / 8 + one A1 sequence's KV + the training peak
    on each GPU; 96 GiB does not hold them, their sum does; offline runs them in turn."""
    params = load(EXAMPLE)
    report = plan.plan(params, CONFIG)
    peak = max(r["peak_bytes"] for r in report["training"])
    engine = 554e9 / 8 + 61 * 576 * 2 * 32768
    modes = {r["mode"]: r for r in report["hidden_modes"]}
    shared = modes["online"]["gpu"]
    assert shared["sum_gib"] == pytest.approx((engine + peak) / GIB)
    assert (engine + peak) / GIB > 96 and not modes["online"]["gpu_fits"]
    assert not modes["online"]["fits"] and not modes["hybrid"]["gpu_fits"]
    assert modes["offline"]["gpu_fits"] is (peak <= 96 * GIB) is True
    options = {o["option"]: o for o in modes["online"]["options"]}
    assert options["engine_elsewhere"]["fits"] and options["offline"]["fits"] is bool(
        modes["offline"]["node_disk_fits"]
    )
    # the longest sample with which both fit, from the training rows' own fixed and per-token
    row = max(report["training"], key=lambda r: r["peak_bytes"])
    fixed, per = sum(row["fixed_bytes"].values()), row["per_token_bytes"]
    n = options["shared_max_length"]["tokens"]
    kv = 61 * 576 * 2
    assert 554e9 / 8 + (kv + per) * n + fixed <= 96 * GIB < 554e9 / 8 + (kv + per) * (n + 1) + fixed
    # the verdict flips exactly at the sum
    at = plan.plan(params, CONFIG, gpu_memory=engine + peak)
    assert {r["mode"]: r["gpu_fits"] for r in at["hidden_modes"]}["online"] is True
    below = plan.plan(params, CONFIG, gpu_memory=engine + peak - 1)
    assert {r["mode"]: r["gpu_fits"] for r in below["hidden_modes"]}["online"] is False
    args = ["plan", "--params", str(EXAMPLE), "--target-config", str(CONFIG), "--json"]
    for gib, fits in ((96, False), (math.ceil((engine + peak) / GIB), True)):
        assert main([*args, "--gpu-memory", str(gib)]) == 0
        modes = {r["mode"]: r for r in json.loads(capsys.readouterr().out)["hidden_modes"]}
        assert modes["online"]["gpu_fits"] is modes["hybrid"]["gpu_fits"] is fits
        assert bool(modes["online"]["options"]) is not fits


def test_an_engine_that_does_not_fit_gets_its_options(tmp_path, capsys):
    """64 GiB GPUs cannot hold Kimi's 554 GB over 8: a second node (TP 16) can, FP8 of the
    parameters would not shrink INT4 experts, and no max_length helps."""
    from eaglet.graph import footprint

    params = load(overlay(tmp_path, "plan: {gpu_memory_gb: 64}\n"))
    report = plan.plan(params, CONFIG)
    hidden = next(r for r in report["stages"]["rows"] if r["stage"].startswith("hidden"))
    assert 0.9 * 64 * GIB < 554e9 / 8 and hidden["fits"].startswith("DOES NOT FIT")
    options = {o["option"]: o for o in hidden["options"]}
    two = options["another_node"]
    assert two["weights_gib"] == pytest.approx(554e9 / 16 / GIB) and two["fits"]
    text = json.loads(CONFIG.read_text())["text_config"]
    assert ("fp8_weights" in options) is (footprint.parameters(text) < 554e9) is False
    assert "engine_max_length" not in options
    ok = plan.plan(load(EXAMPLE), CONFIG)["stages"]["rows"]
    assert all(not r["options"] for r in ok)
    assert (
        main(["plan", "--params", str(tmp_path / "overlay.yaml"), "--target-config", str(CONFIG)])
        == 0
    )
    assert "hidden states (all datasets) options (GPU memory):" in capsys.readouterr().out


def test_training_that_does_not_fit_gets_a_max_length_that_does(tmp_path):
    """At 40 GiB A1's 32,768 tokens do not fit; train.max_length at the proposed length, planned
    again, fits every dataset, and one token more does not."""
    report = plan.plan(load(EXAMPLE), CONFIG, gpu_memory=40 * GIB)
    train = next(r for r in report["stages"]["rows"] if r["stage"].startswith("train "))
    options = {o["option"]: o for o in train["options"]}
    n = options["train_max_length"]["tokens"]
    assert options["train_max_length"]["cut"] == ["A1_deepswekimi"] and 8192 < n < 32768
    peak = max(r["peak_bytes"] for r in report["training"])
    assert options["bigger_gpu"]["peak_gib"] == pytest.approx(peak / GIB)

    def fits_at(tokens: int) -> bool:
        body = f"drafters: {{kimi_k25_eagle3: {{train: {{max_length: {tokens}}}}}}}\n"
        p = overlay(tmp_path, body, f"t-{tokens}.yaml")
        return all(r["fits"] for r in plan.plan(load(p), CONFIG, gpu_memory=40 * GIB)["training"])

    assert fits_at(n) and not fits_at(n + 1)
