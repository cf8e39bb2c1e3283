"""The checkpoint chosen by acceptance, on drafters trained in the test: the chain estimates against
the full-vocab oracle, the best epoch kept through a resume, the curve recorded."""

import csv

import pytest
import torch

from eaglet.formats.drafter import load_drafter
from eaglet.model import ttt
from eaglet.model.target_head import TargetHead, shift
from eaglet.stages.evaluate import kernel as evaluate_kernel
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import kernel as train_kernel

from ...hidden_fixture import HP, MemoryReader, bundle, fit_tiny, hyper
from ...unit.test_select import SELECT


@pytest.fixture(scope="module")
def data():
    """The tiny target's samples, each also under a second id: the held-out split then holds
    answers the drafter learns, so its acceptance moves from epoch to epoch."""
    torch.set_num_threads(2)
    b = bundle(n=16, new_tokens=24)
    twins = [s | {"id": f"{s['id']}-twin"} for s in b["samples"]]
    return b | {"samples": b["samples"] + twins}


def split(b: dict):
    reader = MemoryReader(b["samples"], b["config"])
    train_refs, held = hidden_read.split([reader], HP["heldout_fraction"])
    return reader, train_refs, held


def full_vocab_chain(model, reader, refs, lm_head, steps: int) -> float:
    """The oracle: the teacher-forced chain from whole logits, every step at once: step k's
    draft mapped to a target id against the argmax over the target's full vocab."""
    counts = []
    for ref in refs:
        b = ttt.load([reader], [ref], 1 << 30)
        with torch.no_grad():
            logits = model(b["aux"], b["input_ids"], steps)
            target = (b["last"].float() @ lm_head.float().T).argmax(-1)
        lm, run = b["loss_mask"], torch.ones_like(b["loss_mask"])
        count = torch.zeros(lm.shape, dtype=torch.long)
        for k, lk in enumerate(logits):
            run = run & (model.to_target(lk.argmax(-1)) == shift(target, k + 1)) & shift(lm, k + 2)
            count += run
        counts.append(count[shift(lm, 1) & shift(lm, 2)])
    return float(1 + torch.cat(counts).float().mean())


def test_the_chain_estimates_equal_the_full_vocab_oracle(data, tmp_path):
    """train_kernel.offline_acceptance (cut at max_length, batches of batch_size) and
    evaluate_kernel.offline (whole samples), both draft-vocab p in chunks, against whole
    full-vocab logits."""
    fit_tiny(data, tmp_path / "d", epochs=3)
    model = load_drafter(tmp_path / "d")
    reader, train_refs, held = split(data)
    run = ttt.Run("float32", "cpu")
    head = TargetHead(data["lm_head"], model.t2d)
    hp = hyper(select=SELECT)
    for refs in (train_refs, held):
        oracle = full_vocab_chain(model, reader, refs, data["lm_head"], 3)
        mine = train_kernel.offline_acceptance(model, [reader], refs, hp, head, run)
        full = evaluate_kernel.offline(model, [reader], refs, data["lm_head"], [1, 3])
        assert mine == pytest.approx(oracle, abs=1e-6)
        assert full[3].acceptance_length == pytest.approx(oracle, abs=1e-6)
        assert full[1].acceptance_length <= oracle
    assert oracle > 1.05  # the held-out twins are learnt: the chain is accepted at times


def test_the_best_epoch_is_the_drafter_and_the_curve_is_recorded(data, tmp_path):
    reader, _, held = split(data)
    stats = fit_tiny(data, tmp_path / "d", epochs=4, select=SELECT)
    sel = stats["selected"]
    assert len(sel["curve"]) == 4 and sel["value"] == max(sel["curve"])
    assert sel["epoch"] == sel["curve"].index(max(sel["curve"]))
    assert sel["step"] == (sel["epoch"] + 1) * stats["steps"] // 4
    model = load_drafter(tmp_path / "d")
    full = evaluate_kernel.offline(model, [reader], held, data["lm_head"], [3])  # the kept weights
    assert full[3].acceptance_length == pytest.approx(sel["value"], abs=1e-6)
    with open(tmp_path / "d" / "heldout.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["offline_acceptance_length"]) for r in rows] == pytest.approx(sel["curve"])


def scripted(monkeypatch, curve: list[float]) -> list[dict]:
    """Make the epoch ends measure `curve` in turn; the weights each one saw, returned."""
    seen: list[dict] = []

    def measure(model, *args):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return curve[len(seen) - 1]

    monkeypatch.setattr(train_kernel, "offline_acceptance", measure)
    return seen


def test_an_earlier_epoch_wins_and_survives_a_resume(data, tmp_path, monkeypatch):
    """With epoch 2 of 4 the best, its weights are the drafter's, not the last ones; a run
    stopped after epoch 3 and resumed from its checkpoint ends with the same weights."""
    seen = scripted(monkeypatch, [1.2, 1.5, 1.3, 1.1])
    stats = fit_tiny(data, tmp_path / "full", epochs=4, select=SELECT)
    assert (stats["selected"]["epoch"], stats["selected"]["value"]) == (1, 1.5)
    kept = load_drafter(tmp_path / "full").state_dict()
    for name, t in seen[1].items():
        assert torch.equal(kept[name], t), name
    assert not torch.equal(kept["fc.weight"], seen[3]["fc.weight"])

    per_epoch = stats["steps"] // 4
    real_step = train_kernel.train_step
    calls = {"n": 0}

    def stop_in_epoch_four(t, readers, refs, hp, run, step=0):
        calls["n"] += 1
        if step == 3 * per_epoch + 1 and calls["n"] == step + 1:  # once, in the first run
            raise KeyboardInterrupt
        return real_step(t, readers, refs, hp, run, step)

    monkeypatch.setattr(train_kernel, "train_step", stop_in_epoch_four)
    scripted(monkeypatch, [1.2, 1.5, 1.3, 1.1])
    with pytest.raises(KeyboardInterrupt):
        fit_tiny(data, tmp_path / "resumed", epochs=4, select=SELECT, checkpoint_every=1)
    scripted(monkeypatch, [1.1])  # the resumed run measures only the last epoch end
    again = fit_tiny(data, tmp_path / "resumed", epochs=4, select=SELECT, checkpoint_every=1)
    assert again["resumed_from"] == 3 * per_epoch + 1
    assert again["selected"] == stats["selected"]
    for name, t in load_drafter(tmp_path / "resumed").state_dict().items():
        assert torch.equal(kept[name], t), name
