"""The mission's target shape: a tiny Kimi-K2.5-like model (wrapper config with `text_config`,
DeepSeek-V3 MLA + MoE + YaRN, `language_model.` weights in indexed shards) through the whole
chain on CPU, and the errors a config eaglet cannot size gives."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eaglet import arch
from eaglet.cli import main
from eaglet.errors import EagletError
from eaglet.hidden_store import HiddenReader
from eaglet.io import read_json
from eaglet.keys import Keys, sidecar_of
from eaglet.params import load
from eaglet.target import SMOLLM2, load_config, load_head, materialize, resolve

from .conftest import write_params
from .kimi_fixture import PREFIX, TEXT, WRAPPER, tiny_kimi


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return tiny_kimi(tmp_path_factory.mktemp("kimi") / "target", materialize(resolve(SMOLLM2)))


def test_text_config_head_and_arch_of_the_wrapper(kimi):
    spec = resolve(str(kimi))
    cfg = load_config(spec)
    assert type(cfg).__name__ == "DeepseekV3Config" and cfg.hidden_size == 64
    assert (
        cfg.head_dim == TEXT["qk_rope_head_dim"]
    )  # transformers' MLA head_dim: not a size to copy
    embed, lm_head = load_head(spec)
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[PREFIX + "model.embed_tokens.weight"] != index[PREFIX + "lm_head.weight"]
    from safetensors import safe_open

    with safe_open(kimi / index[PREFIX + "lm_head.weight"], "pt") as f:
        assert torch.equal(lm_head, f.get_tensor(PREFIX + "lm_head.weight"))
    assert embed.shape == lm_head.shape == (49152, 64) and not torch.equal(embed, lm_head)
    a = arch.resolve(TEXT, {}, "config.json", "text_config.")
    assert (a["num_attention_heads"], a["head_dim"], a["num_key_value_heads"]) == (4, 16, 4)
    assert a["intermediate_size"] == 96 and a["rope_theta"] == 50000.0
    assert a["rope_scaling"]["rope_type"] == "yarn" and a["rope_scaling"]["factor"] == 8.0
    assert arch.differs(TEXT, a) == {"head_dim": None}
    mine = arch.resolve(TEXT, {"rope_theta": 1e6, "rope_scaling": None, "head_dim": 32}, "c")
    assert arch.differs(TEXT, mine) == {
        "head_dim": None,
        "rope_theta": 50000.0,
        "rope_scaling": a["rope_scaling"],
    }


def test_a_rope_scaling_the_drafter_lacks_is_a_choice_to_make():
    llama31 = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    llama31 |= {"rms_norm_eps": 1e-5, "rope_theta": 5e5, "max_position_embeddings": 1024}
    llama31["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(EagletError, match="rope_scaling: 'llama3' is not implemented"):
        arch.resolve(llama31, {}, "config.json")
    plain = arch.resolve(llama31, {"rope_scaling": None}, "config.json")
    assert plain["rope_scaling"] is None and plain["head_dim"] == 16
    # implicit sizes (head_dim = hidden / heads, kv heads = heads) are the target's own
    assert arch.differs(llama31, plain) == {"rope_scaling": llama31["rope_scaling"]}


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
    spec = resolve(str(broken))
    with pytest.raises(EagletError, match=message):
        load_config(spec)
        load_head(spec)
        from eaglet.target import read_config, text_config

        text, prefix = text_config(read_config(spec)[0])
        arch.resolve(text, {}, "config.json", prefix)


@pytest.mark.slow
def test_whole_chain_on_a_kimi_shaped_target(kimi, project):
    """prompts, responses, hidden, vocab, train, evaluate, both exports (validated) on CPU."""
    shutil.copytree(kimi, project / "target")
    ds = {"format": "sharegpt", "path": "data/demo/sharegpt.jsonl", "max_samples": 8}
    data = {
        "target": {"model": "target", "max_length": 256},
        "backends": {"local": {"kind": "transformers", "dtype": "float32", "threads": 2}},
        "generation": {"backend": "local", "max_new_tokens": 10},
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
                "evaluate": {"num_steps": [2], "prompts": 2, "max_new_tokens": 6},
            }
        },
    }
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
    assert HiddenReader(keys.path("hidden", "dolly")).manifest["max_length"] == 256
    assert max(s["tokens"] for s in sg["samples"]) <= 96
    prov = keys.provenance("train", "k")["params"]
    assert prov["train"]["max_length"] == 256  # the longest of its datasets
    assert prov["arch"]["head_dim"] == 16 and prov["arch"]["rope_scaling"]["factor"] == 8.0
    assert prov["arch_differs_from_target"] == {"head_dim": None}

    sgl = read_json(keys.path("sglang", "k") / "config.json")
    assert sgl["architectures"] == ["LlamaForCausalLMEagle3"] and sgl["num_hidden_layers"] == 1
    assert sgl["hidden_size"] == TEXT["hidden_size"] and "target_hidden_size" not in sgl
    assert sgl["num_attention_heads"] == sgl["num_key_value_heads"] == 4
    assert sgl["head_dim"] == TEXT["qk_nope_head_dim"] == TEXT["v_head_dim"] != 8
    assert sgl["intermediate_size"] == TEXT["intermediate_size"]
    assert sgl["vocab_size"] == 49152 and sgl["draft_vocab_size"] == 64
    assert sgl["max_position_embeddings"] == 512 and sgl["rope_theta"] == 50000.0
    assert sgl["rope_scaling"]["type"] == sgl["rope_scaling"]["rope_type"] == "yarn"
    assert sgl["rope_scaling"]["factor"] == 8.0
    assert sgl["rope_scaling"]["original_max_position_embeddings"] == 64
    ids = sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 3, 4] and all(0 <= i < TEXT["num_hidden_layers"] for i in ids)
    assert sgl["eaglet"] == {"arch_differs_from_target": {"head_dim": None}}
    vllm = read_json(keys.path("vllm", "k") / "config.json")
    layer = vllm["transformer_layer_config"]
    assert {k: layer[k] for k in ("hidden_size", "head_dim", "rope_scaling")} == {
        k: sgl[k] for k in ("hidden_size", "head_dim", "rope_scaling")
    }
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    verifier = vllm["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]
    for fmt in ("sglang", "vllm"):
        report = read_json(sidecar_of(keys.path(fmt, "k")))["stats"]
        assert report["max_abs_diff"] <= 1e-4
    stats = read_json(sidecar_of(keys.path("evaluate", "k")))["stats"]
    assert stats["suites"]["heldout"]["greedy_equal"]["num_steps_2"] is True
    assert stats["acceptance_length"] >= 1.0
