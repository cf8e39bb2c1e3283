"""The MLA draft layer (`arch.attention: mla`): resolved from the Kimi miniature's MLA sizes, its
training-time test equal to chain decoding, and its training memory against a hand computation.
Trained, exported and computed by vLLM's class: tests/stages/export/test_mla.py."""

import json

import pytest
import torch

from eaglet.errors import EagletError
from eaglet.graph.keys import Keys
from eaglet.model import arch, train_memory
from eaglet.model import drafter as drafter_module
from eaglet.model.drafter import Drafter, DrafterConfig, KVCache
from eaglet.params import load

from ..conftest import tiny_params, write_params
from ..kimi_fixture import TEXT
from .test_drafter import eagle31

MLA_SIZES = {f: TEXT[f] for f in arch.MLA}  # the miniature's: 32, 512 (Kimi's), 32, 64, 32
AUX = [1, 3, 4]  # SGLang's default aux layers of 8 layers
DRAFT_VOCAB = 64


def mla_config(**arch_fields) -> DrafterConfig:
    return DrafterConfig.from_target(TEXT, DRAFT_VOCAB, AUX, {"attention": "mla"} | arch_fields)


# ------------------------------------------------------------------------------ architecture


def test_mla_arch_takes_the_targets_mla_sizes_and_only_when_asked(project):
    """`attention: mla` adds the target's MLA sizes (arch overrides them, q_lora_rank may be
    null); left out or `llama`, the resolved arch, the config and the train key are those of
    before the option existed. A non-MLA target, or a kv-head size on an MLA layer, is one
    error line."""
    llama = arch.resolve(TEXT, {}, "config.json")
    assert "attention" not in llama and not set(arch.MLA) & set(llama)
    assert arch.resolve(TEXT, {"attention": "llama"}, "config.json") == llama
    mla = arch.resolve(TEXT, {"attention": "mla"}, "config.json")
    qk = TEXT["qk_nope_head_dim"] + TEXT["qk_rope_head_dim"]
    assert mla == llama | {"attention": "mla", **MLA_SIZES, "head_dim": qk}
    assert mla["num_key_value_heads"] == mla["num_attention_heads"] == TEXT["num_attention_heads"]
    assert arch.differs(TEXT, mla) == {}
    small = arch.resolve(TEXT, {"attention": "mla", "kv_lora_rank": 128, "q_lora_rank": None}, "c")
    assert (small["kv_lora_rank"], small["q_lora_rank"]) == (128, None)
    assert arch.differs(TEXT, small) == {"kv_lora_rank": 512, "q_lora_rank": 32}
    cfg = DrafterConfig.from_target(TEXT, DRAFT_VOCAB, AUX, {"attention": "mla"})
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["attention"] == "mla"
    plain = DrafterConfig.from_target(TEXT, DRAFT_VOCAB, AUX)
    assert not {"attention", *arch.MLA} & set(plain.to_dict())

    cases = [
        ({"attention": "mla"}, {k: v for k, v in TEXT.items() if k != "kv_lora_rank"}, "needs an"),
        ({"attention": "mla", "head_dim": 64}, TEXT, "head_dim: an MLA layer has none"),
        ({"kv_lora_rank": 64}, TEXT, "kv_lora_rank: MLA sizes need attention: mla"),
    ]
    for fields, text, message in cases:
        with pytest.raises(EagletError, match=message) as e:
            arch.resolve(text, fields, "config.json")
        assert "\n" not in str(e.value)

    data = tiny_params()  # a Llama target (SmolLM2)
    key = Keys(load(write_params(project, data))).key("train", "d")
    data["drafters"]["d"]["arch"] = {"attention": "llama"}
    assert Keys(load(write_params(project, data))).key("train", "d") == key
    data["drafters"]["d"]["arch"] = {"attention": "mla"}
    with pytest.raises(EagletError, match="attention: mla needs an MLA target"):
        Keys(load(write_params(project, data))).key("train", "d")
    data["drafters"]["d"]["arch"] = {"attention": "gqa"}
    with pytest.raises(EagletError, match="attention"):
        load(write_params(project, data))


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_mla_ttt_step_k_is_what_chain_decoding_computes(monkeypatch, q_lora_rank):
    """The MLA layer in training's TTT (step-0 keys causally, then each position's own chain,
    the decompressed keys and values of width qk_nope + qk_rope and v_head_dim) equals step by
    step decoding; with and without a q latent, attention cut into one-row chunks."""
    monkeypatch.setattr(drafter_module, "SCORES", 5)
    model = eagle31(mla_config(q_lora_rank=q_lora_rank), seed=1).eval()
    attn = model.midlayer.self_attn
    assert hasattr(attn, "q_a_proj") == (q_lora_rank is not None)
    aux, ids = torch.randn(1, 9, 3, 64), torch.randint(0, TEXT["vocab_size"], (1, 9))
    with torch.no_grad():
        ttt = model(aux, ids, 3)
        for t in (0, 3, 5):
            cache = KVCache()
            h = model.step(
                model.features(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1), cache
            )
            assert cache.k.shape[1:] == (2, t + 1, 96) and cache.v.shape[1:] == (2, t + 1, 32)
            h = h[:, -1:]
            assert torch.allclose(model.logits(h)[0, 0], ttt[0][0, t], atol=1e-5)
            for k in (1, 2):
                h = model.step(h, ids[:, t + k + 1 : t + k + 2], torch.tensor([t + k]), cache)
                assert torch.allclose(model.logits(h)[0, 0], ttt[k][0, t], atol=1e-5)


# ------------------------------------------------------------------------- training memory


def test_mla_training_memory_against_a_hand_computation():
    """train_memory's MLA layer: its parameters equal the module's count, its keys and values
    the widths the layer caches, and the per-token bytes (bf16 and fp32) equal the derivation
    written out by hand for the Kimi miniature's MLA drafter (H 64, MLP 96, 2 heads of
    qk 32+64 and v 32, latents 32 and 512, draft vocab 64, vocab 768)."""
    cfg = mla_config()
    shape = train_memory.Shape.of(cfg.to_dict(), 64, 768, DRAFT_VOCAB, 3)
    with torch.device("meta"):
        module = Drafter(cfg)
    assert shape.trainable() == sum(p.numel() for p in module.parameters() if p.requires_grad)
    cache = KVCache()
    with torch.no_grad():
        Drafter(cfg).midlayer.self_attn(torch.randn(1, 3, 128), torch.arange(3), cache)
    widths = cache.k.shape[1] * cache.k.shape[3] + cache.v.shape[1] * cache.v.shape[3]
    assert shape.keys_values() == widths == 2 * 96 + 2 * 32

    # by hand, per token, bf16 (a = 2 bytes) and fp32 (f = 4 bytes): sizes in values
    embedding = 2 * 64  # fp32 embedding and its normed copy
    hidden_norms = 2 * 64  # hidden_norm and post-attention norm: input (a), fp32 copy (f)
    cat_in = 2 * 128  # q_a and kv_a read cat(embedding, hidden): two bf16 casts, or once
    mlp_in = 2 * 64  # gate and up read the post-attention norm: two casts, or once
    latents = 32 + 512  # q and kv latents: the norm's input (a) and fp32 copy (f), q_b/kv_b input
    attention = 192 + 64 + (192 - 64)  # queries 2 x 96, output 2 x 32, values padded to 2 x 96
    mlp = 7 * 96  # gate, up, silu, product, and their gradients
    residual = 64  # the attention residual (a) and 2 x 64 fp32 gradient transients
    layer_bf16 = (
        embedding * 4
        + hidden_norms * (2 + 4)
        + cat_in * 2
        + mlp_in * 2
        + latents * (2 + 4 + 2)
        + attention * 2
        + mlp * 2
        + residual * 2
        + 2 * 64 * 4
    )
    layer_fp32 = (
        embedding * 4
        + hidden_norms * 4
        + cat_in // 2 * 4
        + mlp_in // 2 * 4
        + latents * (4 + 4)
        + attention * 4
        + mlp * 4
        + residual * 4
        + 2 * 64 * 4
    )
    kv = 2 * 96 + 2 * 32  # step 0's keys and values
    for dtype, a, layer in (("bfloat16", 2, layer_bf16), ("float32", 4, layer_fp32)):
        inputs = 3 * 64 * a + 4 * 64  # aux in the compute dtype, the final state fp32
        kept = (2 * 64 + kv) * a  # fused features, step 0's output, keys and values
        chunks = (64 + 2 * kv) * a
        first = (64 + kv) * a + layer
        want = inputs + kept + max(chunks, first)
        assert train_memory.per_token(shape, dtype) == want, dtype

    llama = train_memory.Shape.of(arch.resolve(TEXT, {}, "c"), 64, 768, DRAFT_VOCAB, 3)
    assert llama.keys_values() == 2 * 2 * 32 and llama.mla is None


def test_the_plans_training_memory_follows_the_attention(tmp_path):
    """`eaglet plan` on the Kimi example with `arch: {attention: mla}`: each training row is the
    MLA layer's estimate, its weights those of the real module at Kimi-K2.5's size (fewer than
    the Llama layer's), its per-token bytes its own."""
    from eaglet.model.target import text_config
    from eaglet.reports import plan

    from .test_plan import CONFIG, EXAMPLE, overlay

    body = "drafters:\n  kimi_k25_eagle3:\n    arch: {attention: mla}\n"
    rows = {
        kind: {r["dataset"]: r for r in plan.plan(load(p), CONFIG)["training"]}
        for kind, p in (("llama", EXAMPLE), ("mla", overlay(tmp_path, body)))
    }
    text, _ = text_config(json.loads(CONFIG.read_text()))
    cfg = DrafterConfig.from_target(text, 32000, [1, 29, 57], {"attention": "mla"})
    with torch.device("meta"):
        trained = sum(p.numel() for p in Drafter(cfg).parameters() if p.requires_grad)
    shape = train_memory.Shape.of(cfg.to_dict(), 7168, 163840, 32000, 7)
    for ds, row in rows["mla"].items():
        llama = rows["llama"][ds]
        assert row["fixed_bytes"]["weights (fp32)"] == 4 * trained
        assert trained < llama["fixed_bytes"]["weights (fp32)"] / 4
        assert row["per_token_bytes"] == train_memory.estimate(shape, 0)["per_token"]
        assert row["per_token_bytes"] != llama["per_token_bytes"]
        assert row["peak_bytes"] == train_memory.estimate(shape, row["tokens"])["peak"]
