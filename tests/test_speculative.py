"""Speculative decoding reproduces the target's greedy output exactly, and counts acceptance."""

import torch

from eaglet import speculative, train


def test_speculative_decoding_equals_greedy(tiny_drafter, monkeypatch):
    target_model, data, folder = tiny_drafter
    drafter = train.load(folder)
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
