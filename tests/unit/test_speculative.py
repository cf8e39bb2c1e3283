"""Speculative decoding reproduces the target's greedy output exactly, and counts acceptance."""

import torch

from eaglet.model import speculative
from eaglet.stages import train


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


def test_rejection_rule_emits_the_target_distribution():
    """On a toy vocabulary: argmax proposals, accepted by the rule, emit tokens distributed as p
    (the first token, and the second given a context-free p), while accepting the first
    proposal with probability p(x), the theory's rate for a one-hot draft."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.3, 0.4], [0.2] * 5])
    sampling = speculative.Sampling(1.0, g)
    for drafts in ([1, 3], [0, 2], [4, 4]):  # p(x) of 0.2, 0.5 and 0 at the first position
        n_trials, first, second, accepted = 20000, torch.zeros(5), torch.zeros(5), 0
        for _ in range(n_trials):
            n, nxt = sampling.accept(p, drafts)
            emitted = [*drafts[:n], nxt]
            first[emitted[0]] += 1
            accepted += n >= 1
            if len(emitted) > 1:  # the second token, whenever the first was a proposal
                second[emitted[1]] += 1
        assert torch.allclose(first / n_trials, p[0], atol=0.015)  # ~4 standard errors
        assert abs(accepted / n_trials - float(p[0, drafts[0]])) < 0.015
        if second.sum():
            assert torch.allclose(second / second.sum(), p[1], atol=0.025)
    one_hot = torch.eye(5)[[2, 4, 0]]
    assert sampling.accept(one_hot, [2, 4]) == (2, 0)  # a certain target accepts its own token


def test_sampled_speculative_decoding_runs_and_is_seeded(tiny_drafter):
    """At temperature > 0 the decoder samples: seeded runs repeat, different seeds differ, and
    the acceptance is counted as in greedy decoding."""
    target_model, data, folder = tiny_drafter
    drafter = train.load(folder)
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
