"""The draft vocab, the drafter's shapes, TTT == chain decoding, and one TTT loss by hand."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from eaglet.errors import EagletError
from eaglet.graph.keys import Keys
from eaglet.model import arch, target_head, ttt
from eaglet.model import drafter as drafter_module
from eaglet.model.drafter import Drafter, DrafterConfig, KVCache
from eaglet.params import load
from eaglet.stages.vocab import kernel as vocab_kernel

from ..conftest import tiny_params, write_params


def tiny_config(**kw) -> DrafterConfig:
    base = {
        "vocab_size": 12,
        "draft_vocab_size": 6,
        "hidden_size": 8,
        "target_hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "aux_layer_ids": (1, 2, 3),
    }
    return DrafterConfig(**(base | kw))


def eagle31(cfg: DrafterConfig, seed: int = 0) -> Drafter:
    """A drafter of `cfg` whose norms are not ones (so that an option's norm, or a norm read
    by the wrong name, changes its outputs)."""
    torch.manual_seed(seed)
    model = Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "norm." in name:
                p.uniform_(0.5, 1.5)
    return model


def test_vocab_from_hand_built_counts():
    counts = torch.tensor([5, 0, 3, 3, 7, 0, 1])
    d2t, t2d = vocab_kernel.select(counts, 3)  # 4 (7), 0 (5), then 2 beats 3 on the tie by id
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]
    assert d2t.tolist() == [0, 1, 2] and d2t.dtype == torch.int64
    assert t2d.tolist() == [True, False, True, False, True, False, False]
    d2t, t2d = vocab_kernel.select(counts, 6)  # 5 ids occur: padded with the smallest unused (1)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 4, 6]
    assert int(t2d.sum()) == 6 and not t2d[5]
    with pytest.raises(EagletError, match="exceeds the target vocab"):
        vocab_kernel.select(counts, 8)


def test_vocab_counts_only_loss_masked_tokens():
    samples = [
        {
            "id": "a",
            "input_ids": torch.tensor([1, 2, 3, 3]),
            "loss_mask": torch.tensor([0, 0, 1, 1]),
        },
        {"id": "b", "input_ids": torch.tensor([3, 5, 5]), "loss_mask": torch.tensor([1, 1, 0])},
    ]
    for s in samples:
        s["loss_mask"] = s["loss_mask"].bool()
    counts = vocab_kernel.count_tokens([samples], 8)
    assert counts.tolist() == [0, 0, 0, 3, 0, 1, 0, 0]


def test_forward_shapes():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Drafter(cfg)
    assert model.fc.weight.shape == (8, 3 * 8) and model.lm_head.weight.shape == (6, 8)
    assert model.midlayer.self_attn.q_proj.weight.shape == (2 * 4, 2 * 8)
    assert model.midlayer.self_attn.k_proj.weight.shape == (1 * 4, 2 * 8)
    assert not model.embed_tokens.weight.requires_grad
    aux, ids = torch.randn(2, 5, 3, 8), torch.randint(0, 12, (2, 5))
    out = model(aux, ids, 3)
    assert len(out) == 3 and all(o.shape == (2, 5, 6) for o in out)
    masks = [torch.rand(2, 5) > 0.5 for _ in range(3)]
    sums = model(aux, ids, 3, lambda k, states, start: (model.logits(states)[masks[k]].sum(),))
    want = torch.stack([o[m].sum() for o, m in zip(out, masks, strict=True)])
    assert torch.allclose(sums[0], want, atol=1e-5)
    model.d2t.copy_(torch.tensor([0, 1, 1, 3, 3, 6]))
    assert model.to_target(torch.tensor([0, 2, 5])).tolist() == [0, 3, 11]


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4}


ALL_NORMS = dict.fromkeys(arch.NORMS, True)


@pytest.mark.parametrize(
    "scaling,scores,norms",
    [(None, None, {}), (YARN, 5, {}), (None, None, ALL_NORMS), (None, 5, {"norm_output": True})],
)
def test_ttt_step_k_is_what_chain_decoding_computes(monkeypatch, scaling, scores, norms):
    """Training's step k at position t equals decoding: step-0 entries up to t from the target's
    features, then k chain steps on the (teacher-forced) next tokens. Also with YaRN, with
    attention cut into chunks of one query row, and with EAGLE-3.1's options (what a TTT step
    carries forward is what a decoding step carries)."""
    monkeypatch.setattr(drafter_module, "SCORES", scores or drafter_module.SCORES)
    model = eagle31(tiny_config(rope_scaling=scaling, **norms), seed=1).eval()
    aux, ids = torch.randn(1, 9, 3, 8), torch.randint(0, 12, (1, 9))
    with torch.no_grad():
        ttt = model(aux, ids, 3)
        for t in (0, 3, 5):
            cache = KVCache()
            h = model.step(
                model.features(aux[:, : t + 1]), ids[:, 1 : t + 2], torch.arange(t + 1), cache
            )
            h = h[:, -1:]
            assert torch.allclose(model.logits(h)[0, 0], ttt[0][0, t], atol=1e-5)
            for k in (1, 2):
                h = model.step(h, ids[:, t + k + 1 : t + k + 2], torch.tensor([t + k]), cache)
                assert torch.allclose(model.logits(h)[0, 0], ttt[k][0, t], atol=1e-5)


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean() + eps)


def _rope(x, pos, theta=10000.0):
    d = x.numel()
    out = x.clone()
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


@pytest.mark.parametrize("chunked", [False, True])
def test_two_ttt_steps_against_a_hand_computed_loss(monkeypatch, chunked):
    """The loss of ttt_length=2 on a tiny config, recomputed position by position; also with
    the loss and the TTT chain in chunks of one position, recomputed in backward."""
    if chunked:
        monkeypatch.setattr(target_head, "LOGITS", 1)
        monkeypatch.setattr(drafter_module, "RECOMPUTE", 0)
        monkeypatch.setattr(drafter_module, "CHAIN", 1)
    torch.manual_seed(2)
    cfg = tiny_config()
    model = Drafter(cfg)
    model.embed_tokens.weight.normal_()
    ids_v = torch.tensor([0, 2, 3, 5, 7, 8])
    model.t2d[ids_v] = True
    model.d2t.copy_(ids_v - torch.arange(6))
    T = 6
    aux, ids = torch.randn(1, T, 3, 8), torch.randint(0, 12, (1, T))
    last, lm_head = torch.randn(1, T, 8), torch.randn(12, 8)
    lm_head[ids_v] *= 2  # most argmaxes in the draft vocab, not all: both cases are covered
    loss_mask = torch.tensor([[False, True, True, True, True, True]])

    # the library: target distribution, masks, per-step sums, weighted normalized loss
    head = target_head.TargetHead(lm_head, model.t2d)
    in_vocab = head(last, target_head.shift(loss_mask, 1), [(0, "s")])
    masks = ttt.step_masks(loss_mask, in_vocab, 2)
    ce, _ = model(aux, ids, 2, ttt.scorer(model, masks, last, head))
    counts = torch.stack([m.sum() for m in masks]).float()
    got = (torch.tensor([1.0, 0.8]) * ce / counts).sum()

    # by hand
    W = {n: m.weight.detach() for n, m in model.named_modules() if hasattr(m, "weight")}
    E = model.embed_tokens.weight.detach()

    def token(j):
        return E[ids[0, j]] if j < T else E[0]

    def qkv(emb, hid, pos):
        x = torch.cat(
            [_rms(emb, W["midlayer.input_layernorm"]), _rms(hid, W["midlayer.hidden_norm"])]
        )
        q = (W["midlayer.self_attn.q_proj"] @ x).view(2, 4)
        k = (W["midlayer.self_attn.k_proj"] @ x).view(1, 4)
        v = (W["midlayer.self_attn.v_proj"] @ x).view(1, 4)
        return [_rope(qh, pos) for qh in q], _rope(k[0], pos), v[0]

    def finish(hid, q, keys, values):
        heads = []
        for qh in q:  # both query heads share the single kv head
            s = torch.stack([qh @ kk / 2.0 for kk in keys])
            heads.append(sum(w * vv for w, vv in zip(torch.softmax(s, 0), values, strict=True)))
        h = hid + W["midlayer.self_attn.o_proj"] @ torch.cat(heads)
        m = _rms(h, W["midlayer.post_attention_layernorm"])
        mlp = W["midlayer.mlp.down_proj"] @ (
            F.silu(W["midlayer.mlp.gate_proj"] @ m) * (W["midlayer.mlp.up_proj"] @ m)
        )
        return h + mlp

    g = aux[0].flatten(-2) @ W["fc"].T
    step0 = [qkv(token(t + 1), g[t], t) for t in range(T)]
    h0 = [
        finish(
            g[t],
            step0[t][0],
            [step0[s][1] for s in range(t + 1)],
            [step0[s][2] for s in range(t + 1)],
        )
        for t in range(T)
    ]
    h1 = []
    for t in range(T):
        q, k, v = qkv(token(t + 2), h0[t], t + 1)
        keys = [step0[s][1] for s in range(t + 1)] + [k]
        values = [step0[s][2] for s in range(t + 1)] + [v]
        h1.append(finish(h0[t], q, keys, values))
    full = last[0] @ lm_head.T
    want, skipped = 0.0, 0
    for k, hs in enumerate([h0, h1]):
        terms = []
        for t in range(T):
            j = t + k + 1  # the target position whose distribution step k at t learns
            if j + 1 >= T or not loss_mask[0, j + 1] or not model.t2d[full[j].argmax()]:
                continue
            target = torch.softmax(full[j][ids_v], 0)
            logq = torch.log_softmax(W["lm_head"] @ _rms(hs[t], W["norm"]), 0)
            terms.append(-(target * logq).sum())
        assert len(terms) == int(counts[k]) > 0
        skipped += sum(1 for t in range(T - k - 2) if loss_mask[0, t + k + 2]) - len(terms)
        want = want + 0.8**k * torch.stack(terms).mean()
    assert skipped > 0  # a target argmax outside the draft vocab was masked
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def _attend_full(q, k, v, past, diagonal):
    """The explicit score matrix: [B, h, T, S + len(diagonal)] scores, masked, one softmax."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t, s = q.shape[2], k.shape[2]
    allowed = (torch.arange(t)[:, None] + past) >= torch.arange(s)[None, :]
    scores = (q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    diag = [(q * kd.repeat_interleave(g, 1)).sum(-1, keepdim=True) for kd, _ in diagonal]
    w = torch.softmax(torch.cat([scores, *diag], -1) / q.shape[-1] ** 0.5, -1)
    out = w[..., :s] @ v
    for j, (_, vd) in enumerate(diagonal):
        out = out + w[..., s + j : s + j + 1] * vd.repeat_interleave(g, 1)
    return out


def test_argmax_in_draft_vocab_is_kept_per_sample_across_batches(monkeypatch):
    """The in-vocab check computed once per sample (in chunks of 2 rows) equals the full-vocab
    argmax, whatever batch (and padded width) the sample comes back in."""
    monkeypatch.setattr(target_head, "LOGITS", 80)
    torch.manual_seed(3)
    lm_head, t2d = torch.randn(40, 8), torch.zeros(40, dtype=torch.bool)
    t2d[::3] = True
    head = target_head.TargetHead(lm_head, t2d)
    last = torch.randn(3, 7, 8)
    need = torch.ones(3, 7, dtype=torch.bool)
    need[1, 4:] = False  # a shorter sample
    first = head(last, need, [(0, "a"), (0, "b"), (0, "c")])
    assert torch.equal(first, need & t2d[(last @ lm_head.T).argmax(-1)])
    # b alone, padded wider, and a cut narrower: the kept rows, not a recomputation
    last_b = torch.cat([last[1:2, :4], torch.zeros(1, 5, 8)], dim=1)
    need_b = torch.zeros(1, 9, dtype=torch.bool)
    need_b[0, :4] = True
    head.argmax_in_draft = None  # a recomputation would fail
    again = head(last_b, need_b, [(0, "b")])
    assert torch.equal(again[0, :7], first[1]) and not again[0, 7:].any()
    cut = head(last[:1, :5], need[:1, :5], [(0, "a")])
    assert torch.equal(cut[0], first[0, :5])


@pytest.mark.parametrize("chain,norms", [(1, {}), (8, {}), (1, ALL_NORMS)])
def test_chunked_step_has_the_gradients_of_the_unchunked_step(monkeypatch, chain, norms):
    """The training step as train.fit runs a long batch (step 0 whole, then steps 1.. and the
    scores in chunks of 1 or 4 positions of the sequence, the loss in chunks of 3 positions, all
    recomputed in backward) against the plain one: every step's logits and the target's p
    [B, T, Vd] formed whole and kept. Same loss, same gradients (fp32); also with EAGLE-3.1's
    options, their norms' gradients included."""
    cfg = tiny_config(vocab_size=40, draft_vocab_size=16, hidden_size=16, target_hidden_size=16)
    model = eagle31(replace(cfg, **norms), seed=4)
    model.embed_tokens.weight.normal_()
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40)[:16]] = True
    model.t2d.copy_(t2d)
    aux, ids, last = (
        torch.randn(2, 13, 3, 16),
        torch.randint(0, 40, (2, 13)),
        torch.randn(2, 13, 16),
    )
    lm_head = torch.randn(40, 16)
    lm_head[t2d] *= 1.5
    loss_mask = torch.rand(2, 13) > 0.3
    loss_mask[1, 10:] = False  # padding
    head, steps, w = target_head.TargetHead(lm_head, t2d), 3, torch.tensor([1.0, 0.8, 0.64])
    masks = ttt.step_masks(
        loss_mask, head(last, target_head.shift(loss_mask, 1), [(0, "a"), (0, "b")]), steps
    )
    counts = torch.stack([m.sum() for m in masks]).float()
    params = [p for p in model.parameters() if p.requires_grad]

    monkeypatch.setattr(drafter_module, "RECOMPUTE", 10**9)
    p = head.p(last.flatten(0, 1)).view(2, 13, 16)  # before: p whole, every step's logits kept
    logits = [lk[m] for lk, m in zip(model(aux, ids, steps), masks, strict=True)]
    ce = [
        -(ttt.at(p, m, k + 1) * F.log_softmax(lk, -1)).sum()
        for k, (lk, m) in enumerate(zip(logits, masks, strict=True))
    ]
    want = (w * torch.stack(ce) / counts).sum()
    g_want = torch.autograd.grad(want, params)

    monkeypatch.setattr(drafter_module, "RECOMPUTE", 0)
    monkeypatch.setattr(drafter_module, "CHAIN", chain)
    monkeypatch.setattr(target_head, "LOGITS", 3 * 16)
    ce, _ = model(aux, ids, steps, ttt.scorer(model, masks, last, head))
    got = (w * ce / counts).sum()
    g_got = torch.autograd.grad(got, params)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert all(counts > 3)  # every step has several chunks
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("past", [0, 5])
def test_chunked_attention_equals_the_full_score_matrix_with_gradients(past):
    """Chunks of 3 query rows (budget of 3·4·S scores), checkpointed: same outputs and same
    gradients as one explicit [B, h, T, S + k] softmax."""
    torch.manual_seed(3)
    t, s = 11, 11 + past
    q = torch.randn(2, 4, t, 8, requires_grad=True)
    k, v = torch.randn(2, 2, s, 8, requires_grad=True), torch.randn(2, 2, s, 8)
    diagonal = [(torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8)) for _ in range(2 if past else 0)]
    got = drafter_module.attend(q, k, v, past, diagonal, scores=3 * 2 * 4 * s)
    want = _attend_full(q, k, v, past, diagonal)
    assert torch.allclose(got, want, atol=1e-5)
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), (q, k))
    g_want = torch.autograd.grad((want * w).sum(), (q, k))
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_yarn_frequencies_equal_transformers():
    """The drafter's YaRN (inverse frequencies and cos/sin factor) against transformers' own
    implementation, for Kimi-K2.5's scaling and for the plain-factor case."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kimi = {"factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0}
    kimi |= {"beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    for scaling in (kimi, {"factor": 4.0, "original_max_position_embeddings": 512}):
        params = {"rope_type": "yarn", "rope_theta": 50000.0, **scaling}
        cfg = LlamaConfig(
            hidden_size=1024, num_attention_heads=8, head_dim=128, rope_parameters=params
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        mine, my_factor = drafter_module.rope_frequencies(128, 50000.0, scaling)
        assert torch.allclose(mine, inv_freq, rtol=1e-6) and my_factor == pytest.approx(factor)
    assert drafter_module.rope_frequencies(128, 50000.0, kimi)[1] == 1.0  # mscale ratio
    plain, one = drafter_module.rope_frequencies(64, 1e4, None)
    assert one == 1.0 and torch.allclose(plain, 1e4 ** -(torch.arange(0, 64, 2) / 64))


def test_eagle31_options_enter_the_config_weights_and_key_only_when_set(project):
    """Each option adds only its own weights (vLLM's names) and config field; left out or false,
    the drafter is the one trained before the options existed: the same config, state dict and
    first weights, and the same train key (a true one moves it)."""
    plain = tiny_config()
    torch.manual_seed(0)
    before = Drafter(plain).state_dict()
    assert plain.to_dict() == DrafterConfig.from_dict(plain.to_dict()).to_dict()
    assert not set(arch.NORMS) & set(plain.to_dict())
    added = {
        "fc_norm": {f"fc_norm.{i}.weight": (8,) for i in range(3)},
        "norm_before_fc": {"input_norm.weight": (24,)},
        "norm_before_residual": {},
        "norm_output": {},
    }
    for option, weights in added.items():
        cfg = tiny_config(**{option: True})
        assert cfg.to_dict() == plain.to_dict() | {option: True}
        assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
        torch.manual_seed(0)
        state = Drafter(cfg).state_dict()
        assert {n: tuple(t.shape) for n, t in state.items() if n not in before} == weights
        assert all(torch.equal(state[n], t) for n, t in before.items())  # the same draws

    text = {
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "max_position_embeddings": 64,
    }
    base = arch.resolve(text, {}, "t")
    assert arch.resolve(text, dict.fromkeys(arch.NORMS, False), "t") == base
    assert arch.resolve(text, {"norm_output": True}, "t") == base | {"norm_output": True}

    data = tiny_params()
    keys = Keys(load(write_params(project, data)))
    train_key, export_key = keys.key("train", "d"), keys.key("vllm", "d")
    data["drafters"]["d"]["arch"] = dict.fromkeys(arch.NORMS, False)
    assert Keys(load(write_params(project, data))).key("train", "d") == train_key
    for option in arch.NORMS:
        data["drafters"]["d"]["arch"] = {option: True}
        keys = Keys(load(write_params(project, data)))
        assert keys.spec("train", "d").values.arch[option] is True
        assert keys.key("train", "d") != train_key and keys.key("vllm", "d") != export_key
