"""The MLA draft layer (`arch.attention: mla`) trained through the training-time test on the Kimi
miniature's states, exported as Eagle3DeepseekV2ForCausalLM for vLLM and SGLang, and computed by
vLLM's own class from the export (its attention op aside: vLLM's MLA kernel needs a running
engine, and its CPU build does not run speculative decoding on MLA). Its sizes and training
memory: tests/unit/test_mla.py."""

import csv
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.model import arch
from eaglet.model import drafter as drafter_module
from eaglet.model.drafter import Drafter
from eaglet.stages.export import kernel as export_kernel
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.vocab import kernel as vocab_kernel

from ...hidden_fixture import MemoryReader, hyper
from ...kimi_fixture import TEXT
from ...unit.test_drafter import eagle31
from ...unit.test_mla import AUX, DRAFT_VOCAB, MLA_SIZES, mla_config
from ...vllm_fixture import vllm_loader
from .test_export import _broken

# ------------------------------------------------------------------- train, export, vLLM


@pytest.fixture(scope="module")
def trained_mla(tmp_path_factory):
    """An MLA drafter trained by train_kernel.fit (the training-time test, 3 steps) on the Kimi
    miniature's states (its DeepSeek-V3 text model as tests/kimi_fixture.py builds it, lm_head
    scaled so that its next-token distribution is peaked, as a trained model's is) over random
    token sequences, the draft vocab its most frequent argmaxes; and its metrics rows."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(DeepseekV3Config(**TEXT)).eval().requires_grad_(False)
    target.lm_head.weight.mul_(30.0)
    ids = torch.randint(3, TEXT["vocab_size"], (8, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # one batched forward: what hidden_fixture.sample takes per sample
        hs = target(ids, output_hidden_states=True).hidden_states
    answer = torch.arange(48) >= 8  # 8 prompt tokens, then the supervised answer
    samples = [
        {
            "id": f"s{i:04d}",
            "input_ids": ids[i],
            "loss_mask": answer,
            "aux": torch.stack([hs[k + 1][i] for k in AUX], dim=1),
            "last": hs[-1][i],
        }
        for i in range(len(ids))
    ]
    reader = MemoryReader(samples, SimpleNamespace(**TEXT))
    lm_head = target.lm_head.weight.clone()
    argmax = torch.cat([(s["last"] @ lm_head.T).argmax(-1)[answer] for s in samples])
    d2t, t2d = vocab_kernel.select(
        torch.bincount(argmax, minlength=TEXT["vocab_size"]), DRAFT_VOCAB
    )
    embed = target.model.embed_tokens.weight.clone()
    tensors = {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d}
    out = tmp_path_factory.mktemp("mla") / "trained"
    hp = hyper(epochs=10, batch_size=2, heldout_fraction=0.2)
    stats = train_kernel.fit([reader], mla_config(), tensors, hp, out, quiet=True)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return load_drafter(out), stats, rows


@pytest.fixture(scope="module")
def vllm_mla(tmp_path_factory):
    """load(export folder): vLLM's own Eagle3DeepseekV2ForCausalLM from an MLA export, for a
    target of the miniature's text config."""
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    target = tmp_path_factory.mktemp("kimi_text")
    (target / "config.json").write_text(json.dumps(TEXT))
    with vllm_loader(target, max_model_len=256) as load_:
        yield lambda folder: load_(folder, Eagle3DeepseekV2ForCausalLM)


class CachedLatentAttention(nn.Module):
    """In place of vLLM's MLA op (MLAAttention: its paged kernel needs a running engine's
    forward context): MLA in its decode form over the latents seen so far, with what vLLM made
    of the export (W_UK_T [heads, qk_nope, kv_lora] and W_UV [heads, kv_lora, v], split from
    kv_b_proj by its process_weights_after_loading) and its softmax scale. q_nope·W_UK_T is
    scored against the cached latent, the rope part against the cached k_pe, and the weighted
    latent goes through W_UV: eaglet instead decompresses keys and values (the prefill form)."""

    def __init__(self, op: nn.Module):
        super().__init__()
        self.w_uk_t, self.w_uv, self.scale = op.W_UK_T, op.W_UV, op.scale
        self.nope, self.latent, self.k_pe = op.qk_nope_head_dim, None, None

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        k_pe = k_pe.reshape(k_pe.shape[0], -1)  # one rope key per position, shared by heads
        self.latent = kv_c_normed if self.latent is None else torch.cat([self.latent, kv_c_normed])
        self.k_pe = k_pe if self.k_pe is None else torch.cat([self.k_pe, k_pe])
        t, s = q.shape[0], self.latent.shape[0]
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        absorbed = torch.einsum("tnp,npl->ntl", q_nope, self.w_uk_t)
        scores = absorbed @ self.latent.T + torch.einsum("tnr,sr->nts", q_pe, self.k_pe)
        seen = torch.arange(t)[:, None] + s - t >= torch.arange(s)[None, :]
        w = torch.softmax((scores * self.scale).masked_fill(~seen, float("-inf")), -1)
        return torch.einsum("nts,sl,nlv->tnv", w, self.latent, self.w_uv).reshape(t, -1)


def _vllm_logits(served, model: Drafter, aux, ids, positions=(0, 3, 5), steps=3):
    """vLLM's drafter driven as its proposer drives it (combine_hidden_states of the target's
    states at positions 0..t, then chain steps each fed what the step before returned): the
    draft-vocab logits per (t, step)."""
    attn = served.model.layers[0].self_attn.mla_attn
    op = attn.mla_attn
    out = {}
    with torch.no_grad():
        for t in positions:
            attn.mla_attn = CachedLatentAttention(op)
            hidden = served.combine_hidden_states(aux[0, : t + 1].flatten(-2))
            last, carried = served(ids[0, 1 : t + 2], torch.arange(t + 1), hidden)
            for k in range(steps):
                logits = served.compute_logits(last[-1:])[0]  # over the target vocab
                assert torch.isfinite(logits).sum() == model.cfg.draft_vocab_size
                out[t, k] = logits[model.to_target(torch.arange(model.cfg.draft_vocab_size))]
                if k < steps - 1:
                    p = torch.tensor([t + k + 1])
                    last, carried = served(ids[0, t + k + 2 : t + k + 3], p, carried[-1:])
        attn.mla_attn = op
    return out


def _bf16_exact(model: Drafter) -> Drafter:
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.bfloat16().float())  # the export's bf16, exactly
    return model.eval()


def test_an_mla_drafter_trains_exports_and_vllm_computes_its_logits(
    trained_mla, vllm_mla, tmp_path
):
    """Trained on the Kimi miniature's answers (the TTT loss falls), exported for vLLM and
    SGLang (both validated by reloading), loaded by vLLM's own Eagle3DeepseekV2ForCausalLM:
    every tensor lands where vLLM keeps it, and vLLM's module (its projections, norms, DeepSeek
    YaRN rotary, MLP, fc, lm_head; the attention op in MLA's decode form) gives eaglet's TTT
    logits at every step. The rotary layout and the YaRN softmax factor each count: eaglet with
    Llama's rotate-half layout, or without mscale^2, is far off."""
    model, stats, rows = trained_mla
    assert model.cfg.attention == "mla" and stats["final_loss"] is not None
    first = sum(float(r["loss"]) for r in rows[:2]) / 2
    last = sum(float(r["loss"]) for r in rows[-2:]) / 2
    assert stats["steps"] == len(rows) >= 10 and last < 0.7 * first, (first, last)

    folders = {}
    for fmt in ("vllm", "sglang"):
        folders[fmt] = tmp_path / fmt
        folders[fmt].mkdir()
        exports.write(model, fmt, folders[fmt], {"name_or_path": "kimi", "architectures": []})
        report = export_kernel.validate(folders[fmt], model)
        assert report["format"] == fmt and report["max_abs_diff"] <= 1e-4
    vc = json.loads((folders["vllm"] / "config.json").read_text())
    sc = json.loads((folders["sglang"] / "config.json").read_text())
    for c in (vc, sc):
        assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert c["model_type"] == "kimi_k2" and c["num_hidden_layers"] == 1
        assert {f: c[f] for f in arch.MLA} == MLA_SIZES and "head_dim" not in c
        assert c["rope_scaling"]["rope_type"] == c["rope_scaling"]["type"] == "yarn"
    assert vc["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and "eagle_config" not in vc
    assert vc["num_aux_hidden_states"] == 3
    assert {f: vc[f] for f in exports.VLLM_MLA_NORMS} == dict.fromkeys(
        exports.VLLM_MLA_NORMS, False
    )
    assert sc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert "eagle_aux_hidden_state_layer_ids" not in sc
    tensors = load_file(str(folders["vllm"] / "model.safetensors"))
    sgl = load_file(str(folders["sglang"] / "model.safetensors"))
    assert "embed_tokens.weight" in tensors and "embed_tokens.weight" not in sgl
    assert {n.replace("layers.0.", "midlayer.", 1) for n in tensors} - sgl.keys() == {
        "embed_tokens.weight"
    }
    attention = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa"]
    attention += ["kv_a_layernorm", "kv_b_proj", "o_proj"]  # vLLM's and SGLang's names
    assert {n for n in sgl if ".self_attn." in n} == {
        f"midlayer.self_attn.{n}.weight" for n in attention
    }

    served, config, loaded = vllm_mla(folders["vllm"])
    assert config.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    mine = {n: t.float() for n, t in tensors.items()}
    theirs = dict(loaded)  # as load_weights placed them
    pre = "model.layers.0."
    fused = {  # vLLM's merged parameters: the export's tensors stacked in its order
        f"{pre}self_attn.fused_qkv_a_proj.weight": ("q_a_proj", "kv_a_proj_with_mqa"),
        f"{pre}mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
    }
    for name, parts in fused.items():
        where = "self_attn" if "attn" in name else "mlp"
        stacked = torch.cat([mine.pop(f"layers.0.{where}.{p}.weight") for p in parts])
        assert torch.equal(theirs.pop(name), stacked), name
    assert torch.equal(theirs.pop("draft_id_to_target_id"), mine.pop("d2t"))
    mine.pop("t2d")  # vLLM skips it
    # what process_weights_after_loading made of kv_b_proj for decoding: per head, k_nope's
    # rows transposed (W_UK_T [heads, 32, 512]) and v's (W_UV [heads, 512, 32])
    kv_b = mine["layers.0.self_attn.kv_b_proj.weight"].view(2, 32 + 32, 512)
    op = served.model.layers[0].self_attn.mla_attn.mla_attn
    assert torch.equal(op.W_UK_T, kv_b[:, :32])
    assert torch.equal(op.W_UV, kv_b[:, 32:].transpose(1, 2))
    for name, t in mine.items():
        vllm_name = name if name.startswith("lm_head") else f"model.{name}"
        assert torch.equal(theirs.pop(vllm_name), t), name
    assert not theirs, list(theirs)  # every vLLM parameter came from the export

    rounded = Drafter(model.cfg)
    rounded.load_state_dict(model.state_dict())
    _bf16_exact(rounded)
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 9, 3, 64, generator=g) * torch.tensor([1.0, 4.0, 20.0])[:, None]
    ids = torch.randint(0, TEXT["vocab_size"], (1, 9), generator=g)
    got = _vllm_logits(served, rounded, aux, ids)
    with torch.no_grad():
        ttt = rounded(aux, ids, 3)
    for (t, k), logits in got.items():
        assert torch.allclose(logits, ttt[k][0, t], rtol=0, atol=2e-5), (t, k)
    spread = max(float(x.max() - x.min()) for x in got.values())
    assert spread > 1.0  # trained logits, not a flat random head

    variants = {
        "rotate-half RoPE": ("rope_pairs", drafter_module.rope),
        "no YaRN mscale^2": ("mla_scales", lambda d, s: (1.0, d**-0.5)),
    }
    for what, (name, fn) in variants.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(drafter_module, name, fn)
            wrong = Drafter(model.cfg)
            wrong.load_state_dict(rounded.state_dict())
            with torch.no_grad():
                off = wrong.eval()(aux, ids, 3)
        moved = max(float((got[t, k] - off[k][0, t]).abs().max()) for t, k in got)
        assert moved > 100 * 2e-5, (what, moved)


def test_vllm_reads_the_eagle31_options_of_an_mla_export(trained_mla, vllm_mla, tmp_path):
    """fc_norm, norm_output and norm_before_residual (what vLLM's deepseek_eagle3 reads), on
    the trained MLA drafter with norms that are not ones: vLLM's module gives eaglet's logits."""
    model, _, _ = trained_mla
    options = dict.fromkeys(exports.VLLM_MLA_NORMS, True)
    with_options = eagle31(dataclasses.replace(model.cfg, **options), seed=2)
    state = {k: v for k, v in model.state_dict().items() if "norm" not in k}
    with_options.load_state_dict(state, strict=False)
    _bf16_exact(with_options)
    folder = tmp_path / "vllm"
    folder.mkdir()
    exports.write(with_options, "vllm", folder, {})
    assert export_kernel.validate(folder, with_options)["format"] == "vllm"
    served, config, _ = vllm_mla(folder)
    assert all(getattr(config, f) is True for f in exports.VLLM_MLA_NORMS)
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 8, 3, 64, generator=g) * torch.tensor([1.0, 4.0, 20.0])[:, None]
    ids = torch.randint(0, TEXT["vocab_size"], (1, 8), generator=g)
    got = _vllm_logits(served, with_options, aux, ids, positions=(2, 4))
    with torch.no_grad():
        ttt = with_options(aux, ids, 3)
    for (t, k), logits in got.items():
        assert torch.allclose(logits, ttt[k][0, t], rtol=0, atol=2e-5), (t, k)


def test_what_an_engine_cannot_serve_is_refused_in_one_line(trained_mla, tmp_path):
    """vLLM's MLA class has no input_norm (norm_before_fc) and 0.32's loader cannot place an
    MLA layer without q_lora_rank; SGLang's MLA class reads none of EAGLE-3.1's options. The
    validator catches an MLA export that is not the trained drafter. A drafter without
    q_lora_rank still exports for SGLang (q_proj, validated)."""
    model, _, _ = trained_mla
    cases = [
        ("vllm", {"norm_before_fc": True}, "has no norm_before_fc"),
        ("vllm", {"q_lora_rank": None}, "cannot load an MLA layer without q_lora_rank"),
        ("sglang", {"fc_norm": True, "norm_output": True}, "has no fc_norm or norm_output"),
    ]
    for fmt, fields, message in cases:
        bad = Drafter(dataclasses.replace(model.cfg, **fields))
        with pytest.raises(EagletError, match=message) as e:
            exports.write(bad, fmt, tmp_path, {})
        assert "\n" not in str(e.value)
    good = {}
    for fmt in ("vllm", "sglang"):
        good[fmt] = tmp_path / f"good-{fmt}"
        good[fmt].mkdir()
        exports.write(model, fmt, good[fmt], {})
    broken = [  # what the validator catches before an engine loads it silently
        ("vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=AUX), None, "differs"),
        ("sglang", lambda c: c.update(kv_lora_rank=256), None, "has shape"),
        ("sglang", lambda c: c.update(fc_norm=True), None, "ignores fc_norm"),
        ("vllm", None, lambda t: t.pop("layers.0.self_attn.kv_a_layernorm.weight"), "missing"),
        ("vllm", None, lambda t: t["layers.0.self_attn.kv_b_proj.weight"].mul_(0.5), "differ"),
    ]
    for i, (fmt, edit_config, edit_tensors, message) in enumerate(broken):
        bad = _broken(good[fmt], tmp_path / f"bad{i}", edit_config, edit_tensors)
        with pytest.raises(EagletError, match=message):
            export_kernel.validate(bad, model)
    plain_q = Drafter(dataclasses.replace(model.cfg, q_lora_rank=None))
    plain_q.load_state_dict(model.state_dict(), strict=False)  # d2t, t2d, the rest
    folder = tmp_path / "sglang"
    folder.mkdir()
    exports.write(plain_q, "sglang", folder, {})
    assert json.loads((folder / "config.json").read_text())["q_lora_rank"] is None
    names = load_file(str(folder / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in names and not any("q_a_" in n for n in names)
    assert export_kernel.validate(folder, plain_q)["format"] == "sglang"
