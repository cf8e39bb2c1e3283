"""Exports for SGLang and vLLM: exact config fields, tensors, and the validator's round trip."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.model.arch import NORMS
from eaglet.model.drafter import Drafter, DrafterConfig
from eaglet.stages.export import kernel as export_kernel
from eaglet.stages.export import run as export_run

from ...hidden_fixture import TINY, sgl_ids, tiny_llama
from ...unit.test_drafter import eagle31
from ...vllm_fixture import vllm_loader

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
    return load_drafter(tiny_drafter[2])


def test_sglang_export_round_trip(trained, tmp_path):
    out = tmp_path / "sglang"
    out.mkdir()
    exports.write(trained, "sglang", out, VERIFIER)
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
    report = export_kernel.validate(out, trained)
    assert report["format"] == "sglang" and report["aux_layer_ids"] == [1, 3, 4]
    assert min(report["top1_agreement_vs_fp32"]) > 0.9
    cmd = export_run.serve_command("sglang", "org/tiny", "models/d/sglang/k", 3)
    assert "--speculative-algorithm EAGLE3" in cmd and "--speculative-num-draft-tokens 4" in cmd


def test_vllm_export_round_trip(trained, tmp_path):
    out = tmp_path / "vllm"
    out.mkdir()
    exports.write(trained, "vllm", out, VERIFIER, num_steps=3)
    config = json.loads((out / "config.json").read_text())
    assert config == {  # no transformers_version: an incidental version outside the key
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": exports.SPECULATORS_VERSION,
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
    report = export_kernel.validate(out, trained)
    assert report["format"] == "vllm" and report["aux_layer_ids"] == [2, 4, 5]
    cmd = export_run.serve_command("vllm", "org/tiny", "models/d/vllm/k", 3)
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
        exports.write(trained, fmt, good[fmt], VERIFIER)
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
            export_kernel.validate(bad, trained)


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
    exports.write(model, "vllm", out, VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert {f: config[f] for f in exports.NORM_FLAGS} == dict.fromkeys(exports.NORM_FLAGS, True)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["input_norm.weight"].shape == (3 * 256,)
    assert [tensors[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(256,)] * 3
    assert export_kernel.validate(out, model)["format"] == "vllm"
    flipped = _broken(out, tmp_path / "flipped", lambda c: c.update(norm_output=False))
    with pytest.raises(EagletError, match=r"differs from the trained drafter: \{'norm_output'"):
        export_kernel.validate(flipped, model)

    with pytest.raises(EagletError) as e:
        exports.write(model, "sglang", tmp_path, VERIFIER)
    assert str(e.value) == (
        "export --to sglang: SGLang's EAGLE-3 drafter has no norm_before_residual or "
        "norm_before_fc (it would load the export and ignore it): export --to vllm, or train "
        "without it"
    )
    served = eagle31(dataclasses.replace(trained.cfg, fc_norm=True, norm_output=True))
    served.load_state_dict(trained.state_dict(), strict=False)
    out = tmp_path / "sglang"
    out.mkdir()
    exports.write(served, "sglang", out, VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert not {"norm_before_fc", "norm_before_residual"} & set(config)
    tensors = load_file(str(out / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    assert export_kernel.validate(out, served)["format"] == "sglang"


class CachedAttention(nn.Module):
    """In place of vLLM's attention op (its paged kernel needs a running engine's forward
    context): causal softmax attention of one sequence over the keys and values it has seen,
    the op eaglet's `drafter.attend` is (tests/unit/test_drafter.py checks that one against the
    explicit score matrix). q [T, heads x d], k and v [T, kv_heads x d]."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.shape, self.k, self.v = (heads, kv_heads, head_dim), None, None

    def forward(self, q, k, v):
        (h, kv, d), t = self.shape, q.shape[0]
        k, v = k.view(t, kv, d), v.view(t, kv, d)
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        s = self.k.shape[0]
        keys, values = (x.repeat_interleave(h // kv, 1).transpose(0, 1) for x in (self.k, self.v))
        seen = torch.arange(t)[:, None] + s - t >= torch.arange(s)[None, :]
        scores = q.view(t, h, d).transpose(0, 1) @ keys.transpose(1, 2) / d**0.5
        out = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ values
        return out.transpose(0, 1).reshape(t, h * d)


@pytest.fixture(scope="module")
def vllm_drafter(tmp_path_factory):
    """load(export folder): vLLM's own Eagle3LlamaForCausalLM as its loader makes it from a
    speculators export (tests/vllm_fixture.py), on CPU in fp32, attention op aside
    (CachedAttention)."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    target = tmp_path_factory.mktemp("target") / "tiny"
    tiny_llama(target)
    with vllm_loader(target) as load:
        yield lambda folder: load(folder, Eagle3LlamaForCausalLM)[:2]


@pytest.mark.parametrize(
    "options",
    [
        (),
        ("fc_norm",),
        ("norm_before_fc",),
        ("norm_before_residual",),
        ("norm_output",),
        ("fc_norm", "norm_output"),  # EAGLE-3.1 as its paper has it
        ("norm_before_fc", "norm_before_residual", "norm_output"),  # speculators 0.9's defaults
    ],
    ids=lambda options: "+".join(options) or "eagle3",
)
def test_vllm_drafter_computes_eaglets_logits_from_the_export(vllm_drafter, tmp_path, options):
    """vLLM's own drafter, loaded from eaglet's vLLM export, driven as its proposer drives it
    (combine_hidden_states of the target's states at positions 0..t, then chain steps each
    fed the state the step before returned), gives at every step the logits of eaglet's
    training-time test at t (fp32, bf16-exact weights, norms not ones, aux layers of unlike
    scales). Turning the option off in eaglet moves them by far more: each option counts."""
    cfg = DrafterConfig.from_target(
        tiny_llama().config, 256, sgl_ids(TINY["num_hidden_layers"]), dict.fromkeys(options, True)
    )
    model = eagle31(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(generator=g)
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.bfloat16().float())  # the export's bf16, exactly
        model.t2d[torch.arange(256) * 3] = True  # draft id i is target id 3i
        model.d2t.copy_(torch.arange(256) * 2)
    model.eval()
    folder = tmp_path / "vllm"
    folder.mkdir()
    exports.write(model, "vllm", folder, VERIFIER)
    served, config = vllm_drafter(folder)
    assert {f: getattr(config, f) for f in NORMS} == {f: f in options for f in NORMS}

    aux = torch.randn(1, 9, 3, 256, generator=g) * torch.tensor([1.0, 4.0, 20.0])[:, None]
    ids = torch.randint(0, 1024, (1, 9), generator=g)
    attn = served.model.layers[0].self_attn
    with torch.no_grad():
        ttt = model(aux, ids, 3)
        for t in (0, 3, 5):
            attn.attn = CachedAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim)
            hidden = served.combine_hidden_states(aux[0, : t + 1].flatten(-2))
            last, carried = served(ids[0, 1 : t + 2], torch.arange(t + 1), hidden)
            for k in range(3):
                logits = served.compute_logits(last[-1:])[0]  # over the target vocab
                assert torch.isfinite(logits).sum() == 256
                got = logits[model.to_target(torch.arange(256))]
                assert torch.allclose(got, ttt[k][0, t], rtol=0, atol=2e-5), (options, t, k)
                if k < 2:
                    p = torch.tensor([t + k + 1])
                    last, carried = served(ids[0, t + k + 2 : t + k + 3], p, carried[-1:])
        for option in options:  # each option changes what is computed
            off = Drafter(dataclasses.replace(cfg, **{option: False}))
            off.load_state_dict(model.state_dict(), strict=False)
            moved = [(a - b).abs().max() for a, b in zip(off.eval()(aux, ids, 3), ttt, strict=True)]
            assert max(moved) > 0.1, option
