"""Exports for SGLang and vLLM: exact config fields, tensors, and the validator's round trip."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.errors import EagletError
from eaglet.model.arch import NORMS
from eaglet.stages import export, train

from .test_drafter import eagle31

VERIFIER = {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
LAYER = {
    "model_type": "llama",
    "hidden_act": "silu",
    "num_hidden_layers": 1,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 512,
    "vocab_size": 1024,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def trained(tiny_drafter):
    return train.load(tiny_drafter[2])


def test_sglang_export_round_trip(trained, tmp_path):
    out = tmp_path / "sglang"
    out.mkdir()
    export.write(trained, "sglang", out, VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"],
        **LAYER,
        "draft_vocab_size": 256,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
            "use_aux_hidden_state": True,
        },
        "eaglet": {"arch_differs_from_target": {}},
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert sum(k.startswith("midlayer.") for k in tensors) == 10
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"], trained.d2t)
    report = export.validate(out, trained)
    assert report["format"] == "sglang" and report["aux_layer_ids"] == [1, 3, 4]
    assert min(report["top1_agreement_vs_fp32"]) > 0.9
    cmd = export.serve_command("sglang", "org/tiny", "models/d/sglang/k", 3)
    assert "--speculative-algorithm EAGLE3" in cmd and "--speculative-num-draft-tokens 4" in cmd


def test_vllm_export_round_trip(trained, tmp_path):
    out = tmp_path / "vllm"
    out.mkdir()
    export.write(trained, "vllm", out, VERIFIER, num_steps=3)
    config = json.loads((out / "config.json").read_text())
    assert config == {  # no transformers_version: an incidental version outside the key
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": export.SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": VERIFIER,
        },
        "transformer_layer_config": LAYER,
        "draft_vocab_size": 256,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],  # vLLM's convention: SGLang's + 1
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": "bfloat16",
        "eaglet": {"arch_differs_from_target": {}},
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["embed_tokens.weight"].shape == (1024, 256)
    assert sum(k.startswith("layers.0.") for k in tensors) == 10
    assert not any(k.startswith(("midlayer.", "verifier")) for k in tensors)
    report = export.validate(out, trained)
    assert report["format"] == "vllm" and report["aux_layer_ids"] == [2, 4, 5]
    cmd = export.serve_command("vllm", "org/tiny", "models/d/vllm/k", 3)
    assert '"method":"eagle3"' in cmd and '"num_speculative_tokens":3' in cmd


def _broken(src, dst, edit_config=None, edit_tensors=None):
    shutil.copytree(src, dst)
    if edit_config:
        c = json.loads((dst / "config.json").read_text())
        edit_config(c)
        (dst / "config.json").write_text(json.dumps(c))
    if edit_tensors:
        t = load_file(str(dst / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def test_validator_rejects_what_engines_would_load_silently(trained, tmp_path):
    good = {}
    for fmt in ("sglang", "vllm"):
        good[fmt] = tmp_path / fmt
        good[fmt].mkdir()
        export.write(trained, fmt, good[fmt], VERIFIER)
    cases = [
        (
            "sglang",
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]),
            None,
            "differs from the trained drafter",
        ),
        (
            "vllm",
            lambda c: c.pop("norm_before_residual"),
            None,
            "missing field 'norm_before_residual'",
        ),
        ("sglang", lambda c: c.update(architectures=["LlamaForCausalLM"]), None, "neither"),
        ("sglang", None, lambda t: t.pop("fc.weight"), r"missing tensors \['fc.weight'\]"),
        (
            "vllm",
            None,
            lambda t: t.update(
                {"midlayer.mlp.up_proj.weight": t.pop("layers.0.mlp.up_proj.weight")}
            ),
            "unexpected tensors",
        ),
        ("sglang", None, lambda t: t.update(d2t=t["d2t"].flip(0)), "ascending"),
        ("vllm", None, lambda t: t["lm_head.weight"].mul_(0.5), "outputs differ"),
    ]
    for i, (fmt, cfg_edit, t_edit, message) in enumerate(cases):
        bad = _broken(good[fmt], tmp_path / f"bad{i}", cfg_edit, t_edit)
        with pytest.raises(EagletError, match=message):
            export.validate(bad, trained)


# ------------------------------------------------------------------ EAGLE-3.1's options


def test_eagle31_exports_carry_the_options_and_their_weights(trained, tmp_path):
    """vLLM: every flag as the drafter has it, input_norm.weight and fc_norm.{i}.weight. SGLang:
    fc_norm and norm_output (absent when false), the other two refused in one line. Both
    validated by reloading; the validator catches a flag that is not the trained drafter's."""
    cfg = dataclasses.replace(trained.cfg, **dict.fromkeys(NORMS, True))
    model = eagle31(cfg)
    model.load_state_dict(trained.state_dict(), strict=False)  # vocab maps, embeddings
    out = tmp_path / "vllm"
    out.mkdir()
    export.write(model, "vllm", out, VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert {f: config[f] for f in export.NORM_FLAGS} == dict.fromkeys(export.NORM_FLAGS, True)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["input_norm.weight"].shape == (3 * 256,)
    assert [tensors[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(256,)] * 3
    assert export.validate(out, model)["format"] == "vllm"
    flipped = _broken(out, tmp_path / "flipped", lambda c: c.update(norm_output=False))
    with pytest.raises(EagletError, match=r"differs from the trained drafter: \{'norm_output'"):
        export.validate(flipped, model)

    with pytest.raises(EagletError) as e:
        export.write(model, "sglang", tmp_path, VERIFIER)
    assert str(e.value) == (
        "export --to sglang: SGLang's EAGLE-3 drafter has no norm_before_residual or "
        "norm_before_fc (it would load the export and ignore it): export --to vllm, or train "
        "without it"
    )
    served = eagle31(dataclasses.replace(trained.cfg, fc_norm=True, norm_output=True))
    served.load_state_dict(trained.state_dict(), strict=False)
    out = tmp_path / "sglang"
    out.mkdir()
    export.write(served, "sglang", out, VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert not {"norm_before_fc", "norm_before_residual"} & set(config)
    tensors = load_file(str(out / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    assert export.validate(out, served)["format"] == "sglang"
