"""Warm start (`train.init_from`): a drafter in any of the three shapes starts the run, its
lm_head rows mapped onto this run's draft vocabulary."""

import copy
import dataclasses
import shutil

import pytest
import torch

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.model.drafter import Drafter
from eaglet.stages.train import warm_start

from ...hidden_fixture import fit_tiny

VERIFIER = {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def trained(tiny_drafter):
    return load_drafter(tiny_drafter[2])


def folder_of(fmt: str, trained: Drafter, tiny_drafter, tmp_path):
    """The trained drafter as a folder of `fmt`: eaglet's train output, or an export."""
    out = tmp_path / fmt
    if fmt == "eaglet":
        shutil.copytree(tiny_drafter[2], out)
    else:
        out.mkdir()
        exports.write(trained, fmt, out, VERIFIER)
    return out


def other_vocab(trained: Drafter, shared: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocab holding `shared` of the trained drafter's tokens and `new`
    tokens it does not have."""
    old = torch.arange(trained.cfg.draft_vocab_size) + trained.d2t
    outside = torch.tensor([i for i in range(trained.cfg.vocab_size) if i not in set(old.tolist())])
    ids = torch.cat([old[::2][:shared], outside[:new]]).sort().values
    t2d = torch.zeros(trained.cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


@pytest.mark.parametrize("fmt", ["eaglet", "vllm", "sglang"])
def test_each_shape_starts_the_run_and_lm_head_rows_follow_their_tokens(
    fmt, trained, tiny_drafter, tmp_path
):
    folder = folder_of(fmt, trained, tiny_drafter, tmp_path)
    got_fmt, source = warm_start.read(folder, trained.embed_tokens.weight)
    assert got_fmt == fmt
    exact = fmt == "eaglet"  # the exports hold bf16
    for name, t in trained.state_dict().items():
        s = source.state_dict()[name]
        assert torch.equal(s, t) if exact else torch.allclose(s, t, rtol=1e-2, atol=1e-2), name

    d2t, t2d = other_vocab(trained, shared=96, new=96)
    cfg = dataclasses.replace(trained.cfg, draft_vocab_size=len(d2t))
    torch.manual_seed(0)
    fresh = Drafter(cfg)
    fresh.embed_tokens.weight.data.copy_(trained.embed_tokens.weight)
    fresh.d2t.copy_(d2t)
    fresh.t2d.copy_(t2d)
    model = copy.deepcopy(fresh)
    report = warm_start.start_from(model, source)
    assert report == {"rows_copied": 96, "draft_vocab": 192, "source_draft_vocab": 256}

    old = {int(i): r for r, i in enumerate(torch.arange(256) + source.d2t)}
    for row, token in enumerate((torch.arange(192) + d2t).tolist()):
        want = source.lm_head.weight[old[token]] if token in old else fresh.lm_head.weight[row]
        assert torch.equal(model.lm_head.weight[row], want), (row, token)
    for name, t in model.state_dict().items():
        if name in warm_start.OWN:
            if name != "lm_head.weight":
                assert torch.equal(t, fresh.state_dict()[name]), name  # this run's maps
        else:
            assert torch.equal(t, source.state_dict()[name]), name


def test_a_drafter_of_another_shape_is_one_line_naming_the_fields(trained, tiny_drafter, tmp_path):
    folder = folder_of("vllm", trained, tiny_drafter, tmp_path)
    _, source = warm_start.read(folder, trained.embed_tokens.weight)
    cfg = dataclasses.replace(trained.cfg, aux_layer_ids=(1, 3), intermediate_size=256)
    with pytest.raises(EagletError) as e:
        warm_start.check(cfg, source, "params.yaml: drafters.d.train.init_from: drafts/k2")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("params.yaml: drafters.d.train.init_from: drafts/k2:")
    assert "intermediate_size 256 here, 512 in the folder" in msg
    assert "aux_layer_ids (1, 3) here, (1, 3, 4) in the folder" in msg


def test_fit_from_a_drafter_starts_where_it_ended(trained, tiny_drafter, tmp_path):
    """At a vanishing learning rate the run ends where the drafter it started from ended (the
    whole path: fit, the trainer, the saved folder)."""
    data = tiny_drafter[1]
    still = fit_tiny(data, tmp_path / "still", epochs=1, lr=1e-12, init=trained)
    assert still["init_from"] == {"rows_copied": 256, "draft_vocab": 256, "source_draft_vocab": 256}
    kept = load_drafter(tmp_path / "still")
    for name, t in kept.state_dict().items():
        assert torch.allclose(t, trained.state_dict()[name], atol=1e-6), name

    cold = fit_tiny(data, tmp_path / "cold", epochs=1, lr=1e-12)
    assert "init_from" not in cold and cold["final_loss"] != still["final_loss"]
