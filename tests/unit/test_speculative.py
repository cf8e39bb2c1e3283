"""Sampled speculative decoding's rejection rule emits the target's distribution (a toy vocabulary;
the decoding with a trained drafter is in tests/stages/evaluate/test_speculative.py)."""

import torch

from eaglet.model import speculative


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
