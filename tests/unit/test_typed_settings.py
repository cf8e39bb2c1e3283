"""The train and evaluate specs read typed (TrainHyper, EvaluateSettings): built from the very
dict the key hashes, every field of it, and (train) back to that dict for the checkpoint."""

from __future__ import annotations

import pytest

from eaglet.graph.keys import Keys
from eaglet.params import load
from eaglet.stages.evaluate.spec import EvaluateSettings, SuiteDigest
from eaglet.stages.train.spec import DFlashSection, Select, TrainHyper, TrainPhase

from ..conftest import ROOT, tiny_params, write_params


def trainer_dict(values) -> dict:
    return values.train | {"heldout_fraction": values.heldout_fraction}


@pytest.mark.parametrize("name", ["params.yaml", "params.full.yaml"])
def test_the_shipped_params_read_typed_and_round_trip(name):
    params = load(ROOT / name)
    keys = Keys(params)
    for drafter in params.drafters:
        train = keys.spec("train", drafter).values
        assert isinstance(train.hyper, TrainHyper)
        assert train.hyper.as_dict() == trainer_dict(train)
        assert train.hyper.select is None and train.hyper.phases is None  # absent: None
        evaluate = keys.spec("evaluate", drafter).values
        settings = evaluate.settings
        assert isinstance(settings, EvaluateSettings)
        assert list(settings.num_steps) == evaluate.evaluate["num_steps"]
        assert all(isinstance(s, SuiteDigest) for s in (settings.suites or {}).values())


def test_the_optional_train_fields_are_typed_records(project):
    data = tiny_params()
    d = data["drafters"]["d"]
    d["datasets"] = {"sg": 2, "dolly": 1}
    d["train"] |= {
        "select": {"by": "offline_acceptance"},
        "phases": [{"epochs": 1}, {"datasets": ["dolly"], "epochs": 2, "lr_scale": 0.5}],
    }
    values = Keys(load(write_params(project, data))).spec("train", "d").values
    hp = values.hyper
    assert hp.select == Select("offline_acceptance", 3)
    assert hp.mixture == {"sg": 2, "dolly": 1} and hp.epochs is None
    assert hp.phases == (
        TrainPhase({"sg": 2, "dolly": 1}, 1, 1.0, hp.max_length),  # the drafter's datasets
        TrainPhase(("dolly",), 2, 0.5, hp.max_length),
    )
    assert hp.overlong == "truncate" and hp.policy == "truncate"
    assert hp.as_dict() == trainer_dict(values)

    d["method"], d["dflash"] = "dflash", {"mask_token_id": 16}
    d["datasets"] = ["sg", "dolly"]
    for field in ("select", "phases"):
        del d["train"][field]
    values = Keys(load(write_params(project, data))).spec("train", "d").values
    assert values.hyper.method == "dflash"
    assert values.hyper.dflash == DFlashSection(8, 1, 512, 4.0, (1, 14, 26), 30, 16)
    assert values.hyper.mixture is None and values.hyper.as_dict() == trainer_dict(values)


def test_an_unknown_field_is_refused_not_dropped():
    hp = trainer_dict(Keys(load(ROOT / "params.yaml")).spec("train", "demo").values)
    with pytest.raises(TypeError, match="surprise"):
        TrainHyper.of(hp | {"surprise": 1})
