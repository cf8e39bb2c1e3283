"""Speculative decoding reproduces the target's greedy output exactly, and counts acceptance."""

import torch

from eaglet import speculative, train


def test_speculative_decoding_equals_greedy(tiny_drafter):
    target_model, data, folder = tiny_drafter
    drafter = train.load(folder)
    target = speculative.Target(target_model, list(drafter.cfg.aux_layer_ids))
    g = torch.Generator().manual_seed(5)
    prompts = [s["input_ids"][:8].tolist() for s in data["samples"][:6]]  # seen in training
    prompts += [torch.randint(3, 1024, (8,), generator=g).tolist() for _ in range(2)]  # unseen
    stop = {2}
    for steps in (3, 7):
        results = []
        for p in prompts:
            plain = speculative.greedy(target, p, 24, stop)
            spec = speculative.speculate(target, drafter, p, 24, stop, steps)
            assert spec.tokens == plain.tokens
            results.append(spec)
        kept = [n for r in results for n in r.accepted]
        assert 0 in kept and max(kept) == steps  # rejections and fully accepted chains
        m = speculative.acceptance(results, steps)
        assert m["rounds"] == len(kept) and m["generated_tokens"] == 24 * len(prompts)
        assert m["acceptance_length"] == m["generated_tokens"] / m["rounds"] > 1
        assert m["mean_acceptance_length"] == 1 + sum(kept) / len(kept)  # vLLM's definition
        assert len(m["acceptance_rate"]) == steps and 0 < m["acceptance_rate"][0] < 1
