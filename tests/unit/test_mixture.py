"""A drafter's data mixture (`datasets: {name: weight}`): exact per-dataset counts per epoch, the
same order on resume and across processes, the list form's order unchanged, one-line errors.

Most tests drive the sampler (train_data.Steps, eaglet.stages.train.mixture) directly: no model, no
process.
"""

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from eaglet.errors import EagletError
from eaglet.stages.train import data as train_data
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.train import mixture

from ..conftest import tiny_params, write_params
from ..hidden_fixture import hyper


class Ids:
    """A reader's manifest and ids alone: `n` samples of `tokens` tokens each."""

    def __init__(self, name: str, n: int, tokens: int = 10):
        self.ids = [f"{name}{i:03d}" for i in range(n)]
        self.manifest = {
            "dataset": name,
            "samples": [{"id": s, "tokens": tokens + k % 7} for k, s in enumerate(self.ids)],
        }


def run(rank: int = 0, world: int = 1):
    return SimpleNamespace(rank=rank, world=world)


HP = {"heldout_fraction": 0.2, "max_length": 12, "batch_size": 2, "grad_accum": 2, "seed": 7}


def plan(readers, mix=None, epochs=3, rank=0, world=1, **hp) -> train_data.Steps:
    hp = HP | {"epochs": epochs} | hp | ({"mixture": mix} if mix is not None else {})
    return train_data.plan_steps(readers, hyper(**hp), run(rank, world))[0]


def old_order(train_refs: list, seed: int, epoch: int) -> list:
    """The oracle: Steps.order as it was before mixtures (every sample once, one shuffle)."""
    order = list(train_refs)
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


def hamilton(weights: list[int], total: int) -> list[int]:
    """An independent largest-remainder count, in integers (weights integral)."""
    whole = sum(weights)
    base = [total * w // whole for w in weights]
    rem = [total * w % whole for w in weights]
    for i in sorted(range(len(weights)), key=lambda i: (-rem[i], i))[: total - sum(base)]:
        base[i] += 1
    return base


READERS = [Ids("code", 40), Ids("chat", 25), Ids("math", 9)]


def test_the_list_form_draws_the_old_order_exactly():
    for world in (1, 2):
        steps = plan(READERS, world=world)
        assert steps.weights is None
        for epoch in range(3):
            assert steps.order(epoch) == old_order(steps.train, 7, epoch)


@pytest.mark.parametrize(
    "weights", [[2, 1, 1], [1, 1, 1], [0, 3, 1], [5, 0, 0], [1, 10, 7], [0.5, 0.25, 0.25]]
)
def test_each_epoch_follows_the_weights_exactly(weights):
    mix = dict(zip(("code", "chat", "math"), weights, strict=True))
    steps = plan(READERS, mix)
    size = steps.per_epoch * steps.per_step
    integral = [int(w * 4) for w in weights]  # 0.5/0.25/0.25 as 2/1/1
    want = hamilton(integral, size)
    assert sum(want) == size
    pools = [[r for r in steps.train if r[0] == i] for i in range(3)]
    for epoch in range(4):
        order = steps.order(epoch)
        assert len(order) == size
        got = Counter(ref[0] for ref in order)
        assert [got[i] for i in range(3)] == want
        for i, pool in enumerate(pools):  # repeats only beyond the dataset's size, evenly
            per = Counter(r for r in order if r[0] == i)
            full, rest = divmod(want[i], len(pool))
            times = sorted((per[r] for r in pool), reverse=True)
            assert times == [full + 1] * rest + [full] * (len(pool) - rest)
    # what the steps trained, counted from the batches themselves
    seen = steps.seen(steps.count(READERS, hyper(**HP, mixture=mix), range(steps.total)))
    assert [seen[n]["samples"] for n in mix] == [w * 3 for w in want]  # 3 epochs
    assert [seen[n]["weight"] for n in mix] == weights


def test_epochs_differ_and_the_seed_decides():
    mix = {"code": 1, "chat": 2, "math": 1}
    a, b = plan(READERS, mix), plan(READERS, mix)
    assert a.order(0) == b.order(0) and a.order(0) != a.order(1)
    assert plan(READERS, mix, seed=8).order(0) != a.order(0)


def test_a_resumed_run_reads_the_same_batches():
    mix = {"code": 1, "chat": 3, "math": 2}
    full = plan(READERS, mix)
    batches = [full.batch(s) for s in range(full.total)]
    for start in (0, 1, full.per_epoch - 1, full.per_epoch, full.per_epoch + 3, full.total - 1):
        again = plan(READERS, mix)  # a fresh process: nothing cached
        assert [again.batch(s) for s in range(start, again.total)] == batches[start:]
        assert list(again.reads(start)) == list(full.reads(start))


@pytest.mark.parametrize("world", [2, 4])
def test_processes_split_every_global_batch(world):
    mix = {"code": 2, "chat": 1, "math": 1}
    one = plan(READERS, mix, batch_size=2, grad_accum=1, world=world)  # the same global batch
    ranks = [
        plan(READERS, mix, batch_size=2, grad_accum=1, rank=r, world=world) for r in range(world)
    ]
    for step in range(one.total):
        parts = [r.mine(step) for r in ranks]
        assert [ref for p in parts for ref in p] == one.batch(step)
        assert all(len(p) == one.per_step // world for p in parts)


def test_counts_split_a_total_exactly():
    assert mixture.counts([2, 1], 10) == [7, 3]
    assert mixture.counts([1, 1, 1], 10) == [4, 3, 3]  # a tie: the earlier dataset
    assert mixture.counts([0.1, 0.2, 0.3], 6) == [1, 2, 3]  # as written, not the nearest doubles
    assert mixture.counts([0, 1], 5) == [0, 5]
    for total in range(0, 50):
        for w in ([3, 1, 1], [1, 2, 4, 0], [7]):
            assert mixture.counts(w, total) == hamilton(w, total)


def test_bad_weights_are_one_line_errors_naming_the_field(project):
    from eaglet.params import load

    cases = {
        "drafters.d.datasets.sg: -1 is less than the minimum of 0": {"sg": -1, "dolly": 1},
        "drafters.d.datasets: every weight is 0": {"sg": 0, "dolly": 0},
        "drafters.d.datasets.nope: unknown dataset 'nope'": {"sg": 1, "nope": 1},
        "drafters.d.datasets.sg: 'x' is not of type 'number'": {"sg": "x"},
    }
    for message, datasets in cases.items():
        data = tiny_params()
        data["drafters"]["d"]["datasets"] = datasets
        with pytest.raises(EagletError) as e:
            load(write_params(project, data))
        assert message in str(e.value) and "\n" not in str(e.value)
    # a weighted dataset with nothing to train on (here: everything skipped as overlong)
    readers = [Ids("code", 20), Ids("chat", 10), Ids("math", 5, tokens=50)]
    with pytest.raises(EagletError, match=r"^datasets.math: weight 1 but no training sample"):
        plan(readers, {"code": 1, "chat": 1, "math": 1}, overlong="skip")
    # weight 0: allowed, that dataset trains nothing
    steps = plan(readers, {"code": 1, "chat": 1, "math": 0}, overlong="skip")
    assert not any(r[0] == 2 for r in steps.order(0))


def test_the_weights_are_in_the_train_key_and_the_list_form_adds_nothing(project):
    from eaglet.graph.keys import Keys
    from eaglet.params import load

    def spec_and_key(datasets):
        data = tiny_params()
        data["drafters"]["d"]["datasets"] = datasets
        keys = Keys(load(write_params(project, data)))
        return keys.spec("train", "d").values.train, keys.key("train", "d")

    listed, k_list = spec_and_key(["sg", "dolly"])
    assert "mixture" not in listed
    weighted, k_2_1 = spec_and_key({"sg": 2, "dolly": 1})
    assert weighted["mixture"] == {"sg": 2, "dolly": 1}
    _, k_1_2 = spec_and_key({"sg": 1, "dolly": 2})
    assert len({k_list, k_2_1, k_1_2}) == 3


@pytest.fixture(scope="module")
def tiny2():
    """Two datasets of the tiny target (code: 8 samples, chat: 6), its drafter config and the
    tensors training needs."""
    import torch

    from eaglet.model.drafter import DrafterConfig
    from eaglet.stages.vocab import kernel as vocab_kernel

    from ..hidden_fixture import TINY, MemoryReader, bundle, sgl_ids

    torch.set_num_threads(1)
    data = bundle(n=14, new_tokens=6)
    readers = [MemoryReader(data["samples"][:8], data["config"])]
    readers.append(MemoryReader(data["samples"][8:], data["config"]))
    for name, r in zip(("code", "chat"), readers, strict=True):
        r.manifest["dataset"] = name
    cfg = DrafterConfig.from_target(data["config"], 64, sgl_ids(TINY["num_hidden_layers"]))
    d2t, t2d = vocab_kernel.select(vocab_kernel.count_tokens(readers, cfg.vocab_size), 64)
    tensors = {"embed": data["embed"], "lm_head": data["lm_head"], "d2t": d2t, "t2d": t2d}
    return readers, cfg, tensors


def test_training_reports_what_each_dataset_trained(tiny2, tmp_path):
    """End to end through train_kernel.fit on the tiny target: two datasets weighted 1:3; the stats
    (the train sidecar's) and `eaglet status` give each one's samples, tokens and steps."""
    from eaglet.reports.status import _details

    readers, cfg, tensors = tiny2
    mix = {"code": 1, "chat": 3}  # chat (6 samples) up-weighted beyond its size
    hp = hyper(epochs=2, batch_size=2, ttt_length=2, mixture=mix)
    stats = train_kernel.fit(readers, cfg, tensors, hp, tmp_path / "out", quiet=True)

    steps = train_data.plan_steps(readers, hp, run())[0]
    want = hamilton([1, 3], steps.per_epoch * steps.per_step)
    seen = stats["datasets"]
    assert [seen["code"]["samples"], seen["chat"]["samples"]] == [2 * w for w in want]
    assert seen["chat"]["samples"] > len([r for r in steps.train if r[0] == 1])  # repeats
    tokens = {(i, s["id"]): len(s["input_ids"]) for i, r in enumerate(readers) for s in r}
    batches = [steps.batch(s) for s in range(stats["steps"])]
    for i, name in enumerate(("code", "chat")):  # counted again from the batches
        mine = [ref for b in batches for ref in b if ref[0] == i]
        assert seen[name]["tokens"] == sum(tokens[ref] for ref in mine)
        assert seen[name]["steps"] == sum(any(ref[0] == i for ref in b) for b in batches)
    assert seen["code"]["weight"] == 1 and seen["chat"]["weight"] == 3
    row = {"state": "up to date", "stage": "train", "stats": stats}
    line = _details(row)
    c, h = seen["code"], seen["chat"]
    assert f"code (weight 1) {c['samples']} samples/{c['tokens']} tok/{c['steps']} steps" in line
    assert f"chat (weight 3) {h['samples']} samples/" in line


PHASES = [
    {"datasets": ["code", "chat"], "epochs": 1, "lr_scale": 1.0, "max_length": 12},
    {"datasets": {"code": 1, "math": 2}, "epochs": 2, "lr_scale": 0.5, "max_length": 9},
    {"datasets": {"chat": 1}, "epochs": 1, "lr_scale": 0.25, "max_length": 12},
]


def test_phases_run_in_order_each_its_own_mixture():
    steps = plan(READERS, phases=PHASES)
    ends, first = [], 0
    for k, ph in enumerate(steps.phases):
        n = steps.steps_per_epoch(ph) * PHASES[k]["epochs"]
        ends.append((first, first + n))
        first += n
    assert steps.total == first
    names = ["code", "chat", "math"]
    for k, (a, b) in enumerate(ends):
        allowed = {names.index(n) for n in PHASES[k]["datasets"]}
        per_epoch = steps.steps_per_epoch(steps.phases[k])
        for step in range(a, b):
            assert {ref[0] for ref in steps.batch(step)} <= allowed
            assert steps.lr_scale(step) == PHASES[k]["lr_scale"]
            assert steps.phase(step).max_length == PHASES[k]["max_length"]
            assert steps.epoch_end(step) == ((step - a) % per_epoch == per_epoch - 1)
    # phase 1 (weighted) follows its weights exactly, epoch by epoch; math at max_length 9
    # skips nothing here (truncate), and epochs are numbered on across phases
    a, b = ends[1]
    per_epoch = steps.steps_per_epoch(steps.phases[1])
    for e in range(2):
        batches = [steps.batch(s) for s in range(a + e * per_epoch, a + (e + 1) * per_epoch)]
        got = Counter(ref[0] for batch in batches for ref in batch)
        assert [got[0], got[2]] == hamilton([1, 2], per_epoch * steps.per_step)
        assert steps.locate(a + e * per_epoch) == (1, 1 + e, 0)
    # the sidecar's counts: per phase, and tokens cut at each phase's max_length
    parts = steps.count(READERS, hyper(**HP), range(steps.total))
    assert [p["steps"] for p in parts] == [b - a for a, b in ends]
    assert all(
        p["datasets"][n]["tokens"] <= p["datasets"][n]["samples"] * PHASES[k]["max_length"]
        for k, p in enumerate(parts)
        for n in names
    )
    assert parts[1]["datasets"]["chat"] == {"weight": 0, "samples": 0, "tokens": 0, "steps": 0}
    total = steps.seen(parts)
    assert total["code"]["samples"] == sum(p["datasets"]["code"]["samples"] for p in parts)


def test_phases_resume_at_any_step_and_split_across_processes():
    full = plan(READERS, phases=PHASES)
    batches = [full.batch(s) for s in range(full.total)]
    boundary = full.steps_per_epoch(full.phases[0])  # phase 0 has one epoch
    for start in (0, 1, boundary - 1, boundary, boundary + 1, full.total - 1):
        again = plan(READERS, phases=PHASES)  # a fresh process: nothing cached
        assert [again.batch(s) for s in range(start, again.total)] == batches[start:]
        assert list(again.reads(start)) == list(full.reads(start))
    world = 2
    ranks = [
        plan(READERS, phases=PHASES, grad_accum=1, batch_size=2, rank=r, world=world)
        for r in range(world)
    ]
    one = plan(READERS, phases=PHASES, grad_accum=1, batch_size=4)
    assert one.total == ranks[0].total
    for step in range(one.total):
        assert [ref for r in ranks for ref in r.mine(step)] == one.batch(step)


def test_a_phase_naming_a_dataset_the_drafter_does_not_read_is_one_line(project):
    from eaglet.params import load

    cases = {
        "drafters.d.train.phases.1.datasets.code: the drafter does not read dataset 'code'": [
            {"epochs": 1},
            {"datasets": ["sg", "code"], "epochs": 1},
        ],
        "drafters.d.train.phases.0.datasets: every weight is 0": [
            {"datasets": {"sg": 0}, "epochs": 1}
        ],
        "drafters.d.train.phases.0.datasets.dolly: -2 is less than the minimum of 0": [
            {"datasets": {"sg": 1, "dolly": -2}, "epochs": 1}
        ],
        "drafters.d.train.phases.0: 'epochs' is a required property": [{"datasets": ["sg"]}],
    }
    for message, phases in cases.items():
        data = tiny_params()
        data["drafters"]["d"]["train"]["phases"] = phases
        with pytest.raises(EagletError) as e:
            load(write_params(project, data))
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(EagletError, match=r"^train.phases.0.datasets.nope: the drafter does not"):
        plan(READERS, phases=[{"datasets": ["nope"], "epochs": 1, "lr_scale": 1, "max_length": 9}])


def test_phases_are_keyed_whole_and_resolved(project):
    from eaglet.graph.keys import Keys
    from eaglet.params import load

    def spec_and_key(phases, datasets=("sg", "dolly")):
        data = tiny_params()
        data["drafters"]["d"]["datasets"] = (
            datasets if isinstance(datasets, dict) else list(datasets)
        )
        if phases is not None:
            data["drafters"]["d"]["train"]["phases"] = phases
        keys = Keys(load(write_params(project, data)))
        return keys.spec("train", "d").values.train, keys.key("train", "d")

    plain, k0 = spec_and_key(None)
    assert "phases" not in plain and "epochs" in plain
    two = [{"epochs": 1}, {"datasets": {"dolly": 1}, "epochs": 2, "lr_scale": 0.5}]
    spec, k1 = spec_and_key(two)
    assert "epochs" not in spec  # the phases' epochs count
    assert spec["phases"] == [
        {
            "datasets": ["sg", "dolly"],
            "epochs": 1,
            "lr_scale": 1.0,
            "max_length": spec["max_length"],
        },
        {"datasets": {"dolly": 1}, "epochs": 2, "lr_scale": 0.5, "max_length": spec["max_length"]},
    ]
    _, k2 = spec_and_key(two[::-1])
    _, k3 = spec_and_key([two[0], two[1] | {"lr_scale": 0.25}])
    assert len({k0, k1, k2, k3}) == 4


def test_training_in_phases_resumes_at_the_boundary(tiny2, tmp_path, monkeypatch):
    """End to end: code alone (max_length 10), then code and chat 1:3 at half the lr; a run
    stopped at the phase boundary resumes to the uninterrupted run's weights and metrics."""
    import csv

    import torch
    from safetensors.torch import load_file

    readers, cfg, tensors = tiny2
    phases = [
        {"datasets": ["code"], "epochs": 1, "lr_scale": 1.0, "max_length": 10},
        {"datasets": {"code": 1, "chat": 3}, "epochs": 1, "lr_scale": 0.5, "max_length": 14},
    ]
    hp = hyper(batch_size=2, ttt_length=2, phases=phases, epochs=None)  # the phases' epochs
    steps = train_data.plan_steps(readers, hp, run())[0]
    boundary = steps.steps_per_epoch(steps.phases[0])
    real_step, lengths, calls = train_kernel.train_step, {}, {"n": 0}

    def stop_at_the_boundary(t, readers, refs, hp, run, step=0):
        calls["n"] += 1
        lengths[step] = hp.max_length
        if step == boundary and calls["n"] == step + 1:  # once, in the interrupted run
            raise KeyboardInterrupt
        return real_step(t, readers, refs, hp, run, step)

    full = train_kernel.fit(readers, cfg, tensors, hp, tmp_path / "full", quiet=True)
    assert full["steps"] == steps.total and full["resumed_from"] == 0
    monkeypatch.setattr(train_kernel, "train_step", stop_at_the_boundary)
    with pytest.raises(KeyboardInterrupt):
        train_kernel.fit(readers, cfg, tensors, hp, tmp_path / "cut", boundary, quiet=True)
    from eaglet.reports.status import _partial

    at = _partial(tmp_path / "cut", "train")  # what `eaglet status` shows of the stopped run
    assert at["step"] == boundary and at["datasets"]["chat"]["samples"] == 0
    assert at["datasets"]["code"]["samples"] == boundary * steps.per_step
    again = train_kernel.fit(readers, cfg, tensors, hp, tmp_path / "cut", boundary, quiet=True)
    assert again["resumed_from"] == boundary
    assert again["datasets"] == full["datasets"] and again["phases"] == full["phases"]
    assert [lengths[s] for s in range(steps.total)] == [10] * boundary + [14] * (
        steps.total - boundary
    )
    a, b = (
        load_file(str(tmp_path / "full" / "model.safetensors")),
        load_file(str(tmp_path / "cut" / "model.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [
        list(csv.DictReader((tmp_path / d / "metrics.csv").read_text().splitlines()))
        for d in ("full", "cut")
    ]
    assert rows[0] == rows[1]
    warmup = max(1, -(-hp.warmup_ratio * steps.total // 1))
    for r in rows[0]:  # the one schedule, times each phase's lr_scale
        s = int(r["step"]) - 1
        scale = 1.0 if s < boundary else 0.5
        want = hp.lr * train_kernel.lr_factor(s, int(warmup), steps.total, hp.min_lr_ratio) * scale
        assert float(r["lr"]) == pytest.approx(want, rel=1e-6)
    assert [p["steps"] for p in full["phases"]] == [boundary, steps.total - boundary]
    code0 = full["phases"][0]["datasets"]["code"]
    assert code0["tokens"] == 10 * code0["samples"]  # 14-token samples cut at 10
    assert full["phases"][0]["datasets"]["chat"]["samples"] == 0
    assert full["datasets"]["chat"]["samples"] == full["phases"][1]["datasets"]["chat"]["samples"]
