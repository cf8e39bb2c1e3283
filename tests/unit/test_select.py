"""The checkpoint chosen by acceptance (`train.select`) enters the train key only when it changes
the weights (its training runs are in tests/stages/train/test_select.py)."""

from eaglet.graph.keys import Keys
from eaglet.params import load

from ..conftest import tiny_params, write_params

SELECT = {"by": "offline_acceptance", "num_steps": 3}


def test_select_enters_the_train_key_only_when_it_changes_the_weights(project):
    data = tiny_params()
    plain = Keys(load(write_params(project, data))).key("train", "d")
    data["drafters"]["d"]["train"]["select"] = {"by": "last"}
    assert Keys(load(write_params(project, data))).key("train", "d") == plain
    data["drafters"]["d"]["train"]["select"] = SELECT
    by_acceptance = Keys(load(write_params(project, data))).key("train", "d")
    data["drafters"]["d"]["train"]["select"] = {"by": "offline_acceptance", "num_steps": 5}
    assert (
        len({plain, by_acceptance, Keys(load(write_params(project, data))).key("train", "d")}) == 3
    )
