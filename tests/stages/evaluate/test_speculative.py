"""Speculative decoding with the tiny drafter (trained once per run) reproduces the target's greedy
output exactly and counts acceptance; a real vLLM engine serves an EAGLE-3.1 export as eaglet's
own decoding decodes it."""

import pytest
import torch

from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.model import speculative
from eaglet.model.drafter import DrafterConfig
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.vocab import kernel as vocab_kernel

from ...hidden_fixture import MemoryReader, hyper, sgl_ids, tiny_llama


def test_speculative_decoding_equals_greedy(tiny_drafter, monkeypatch):
    target_model, data, folder = tiny_drafter
    drafter = load_drafter(folder)
    target = speculative.Target(target_model, list(drafter.cfg.aux_layer_ids))
    g = torch.Generator().manual_seed(5)
    # seen in training, of several lengths (the batch left-pads them)
    prompts = [s["input_ids"][: 5 + i % 4].tolist() for i, s in enumerate(data["samples"][:6])]
    prompts += [torch.randint(3, 1024, (8,), generator=g).tolist() for _ in range(2)]  # unseen
    stop = {2}
    plain = speculative.decode(target, prompts, 24, stop)
    alone = [speculative.decode(target, [p], 24, stop)[0] for p in prompts]
    assert [r.tokens for r in alone] == [r.tokens for r in plain]  # batching changes nothing
    monkeypatch.setattr(speculative, "BATCH", 3)  # speculative: batches of 3, 3 and 2
    for steps in (3, 7):
        ended = []
        results = speculative.decode(target, prompts, 24, stop, drafter, steps, ended.append)
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert sorted(r.tokens for r in ended) == sorted(r.tokens for r in results)
        kept = [n for r in results for n in r.accepted]
        assert 0 in kept and max(kept) == steps  # rejections and fully accepted chains
        m = speculative.acceptance(results, steps)
        assert m["rounds"] == len(kept) and m["generated_tokens"] == 24 * len(prompts)
        assert m["acceptance_length"] == m["generated_tokens"] / m["rounds"] > 1
        assert m["mean_acceptance_length"] == 1 + sum(kept) / len(kept)  # vLLM's definition
        assert len(m["acceptance_rate"]) == steps and 0 < m["acceptance_rate"][0] < 1
        single = speculative.decode(target, prompts[:1], 24, stop, drafter, steps)[0]
        assert single.accepted == results[0].accepted  # each row decodes as it would alone


def test_sampled_speculative_decoding_runs_and_is_seeded(tiny_drafter):
    """At temperature > 0 the decoder samples: seeded runs repeat, different seeds differ, and
    the acceptance is counted as in greedy decoding."""
    target_model, data, folder = tiny_drafter
    drafter = load_drafter(folder)
    target = speculative.Target(target_model, list(drafter.cfg.aux_layer_ids))
    prompts = [s["input_ids"][:6].tolist() for s in data["samples"][:4]]

    def run(seed: int) -> list[speculative.Decoded]:
        sampling = speculative.Sampling(0.7, torch.Generator().manual_seed(seed))
        return speculative.decode(target, prompts, 16, {2}, drafter, 3, sampling=sampling)

    a, b, c = run(0), run(0), run(1)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    m = speculative.acceptance(a, 3)
    assert m["rounds"] == sum(r.rounds for r in a) and m["acceptance_length"] >= 1
    assert all(len(r.tokens) == 16 or r.tokens[-1] == 2 for r in a)  # max_new or the stop id


@pytest.mark.engine
def test_vllm_serves_an_eagle31_export_as_eaglet_decodes_it(tiny_drafter, tmp_path):
    """EAGLE-3.1 (fc_norm + norm_output) trained like the tiny drafter (the tiny target's own
    greedy answers), its vLLM export served by stock vLLM (CPU build, fp32, eager, 3 steps):
    the engine's greedy text is the target's plain greedy text, and its counters are those of
    eaglet's own speculative decoding with the same weights: the same drafts, acceptance length
    and rate per position, so the engine computes the drafts eaglet's math makes."""
    from eaglet.engines.vllm.config import ServeConfig
    from eaglet.engines.vllm.server import Engine
    from eaglet.formats.speculative import eagle3
    from eaglet.stages.evaluate import engine as evaluate_engine
    from eaglet.stages.export import kernel as export_kernel

    target_model, data, _ = tiny_drafter
    reader = MemoryReader(data["samples"], data["config"])
    options = {"fc_norm": True, "norm_output": True}
    cfg = DrafterConfig.from_target(data["config"], 256, sgl_ids(8), options)
    d2t, t2d = vocab_kernel.select(vocab_kernel.count_tokens([reader], cfg.vocab_size), 256)
    tensors = {"embed": data["embed"], "lm_head": data["lm_head"], "d2t": d2t, "t2d": t2d}
    train_kernel.fit([reader], cfg, tensors, hyper(), tmp_path / "trained", 1000, quiet=True)
    drafter = load_drafter(tmp_path / "trained")
    assert drafter.cfg.fc_norm and drafter.cfg.norm_output

    folder = tmp_path / "target"
    tiny_llama(folder)
    verifier = {"name_or_path": str(folder), "architectures": ["LlamaForCausalLM"]}
    out = tmp_path / "vllm"
    out.mkdir()
    exports.write(drafter, "vllm", out, verifier, num_steps=3)
    export_kernel.validate(out, drafter)

    # eaglet's decoding with the weights vLLM serves (the export's bf16, in fp32)
    prompts = [s["input_ids"][:8].tolist() for s in data["samples"]]
    exported = exports.load_export(out)[1]
    target = speculative.Target(target_model, list(drafter.cfg.aux_layer_ids))
    plain = [r.tokens for r in speculative.decode(target, prompts, 24, {2})]
    own = speculative.decode(target, prompts, 24, {2}, exported, 3)
    oracle = speculative.acceptance(own, 3)
    assert [r.tokens for r in own] == plain and oracle["mean_acceptance_length"] > 1.05
    config = ServeConfig(
        model=str(folder),
        max_model_len=512,
        threads=2,
        speculative=eagle3(out, 3),
        extra_args=("--skip-tokenizer-init",),
    )
    with Engine(config, log=tmp_path / "log") as engine:
        served = evaluate_engine.run(engine, "target", prompts, 24, [2], 1)
    m = served["counters"].summary()
    assert served["outputs"] == plain
    assert m["drafts"] == oracle["rounds"]
    assert m["acceptance_length"] == pytest.approx(oracle["mean_acceptance_length"], abs=0.02)
    assert m["acceptance_rate"] == pytest.approx(oracle["acceptance_rate"], abs=0.05)
