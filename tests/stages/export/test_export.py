"""vLLM's own drafter class, loaded from eaglet's vLLM export, computes eaglet's logits (vLLM's
classes on CPU, no engine)."""

import dataclasses

import pytest
import torch
from torch import nn

from eaglet.model.arch import NORMS
from eaglet.model.drafter import Drafter, DrafterConfig
from eaglet.stages import export

from ...hidden_fixture import TINY, sgl_ids, tiny_llama
from ...unit.test_drafter import eagle31
from ...unit.test_export import VERIFIER
from ...vllm_fixture import vllm_loader


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
    export.write(model, "vllm", folder, VERIFIER)
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
