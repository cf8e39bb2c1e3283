"""The engine layer: what each engine can do, and the one lookup the stages use."""

from __future__ import annotations

import pytest
import yaml

from eaglet.engines import lookup
from eaglet.errors import EagletError
from eaglet.params import load


def test_each_engine_declares_what_it_can_do_and_has_a_factory_for_it():
    can = {kind: lookup.engine(kind, "generate", "f").CAN for kind in lookup.ENGINES}
    assert can == {
        "transformers": {"generate", "hidden", "speculate"},
        "vllm": {"generate", "hidden", "speculate"},
        "sglang": {"generate", "hidden"},
        "openai": {"generate"},
    }
    for kind in lookup.ENGINES:
        module = lookup.engine(kind, "generate", "f")
        assert callable(module.generator)
        assert hasattr(module, "hidden_states") == ("hidden" in module.CAN), kind


def test_a_job_the_engine_cannot_do_is_one_line_naming_the_field(tmp_path):
    path = tmp_path / "params.yaml"
    data = {"target": {"model": "smollm2-135m-instruct"}, "datasets": {"a": {"path": "a.jsonl"}}}
    path.write_text(yaml.safe_dump(data))
    params = load(path)
    params.data["hidden"]["backend"] = "openai"  # what the schema keeps out of a params file
    with pytest.raises(EagletError) as e:
        lookup.hidden_states(params, target=None, layer_ids=[1])
    assert str(e.value) == (
        f"{path}: hidden.backend: openai cannot give hidden states (it can: generate)"
    )
    with pytest.raises(EagletError, match=r"^f: sglang cannot decode with a drafter \(it can: "):
        lookup.engine("sglang", "speculate", "f")
    with pytest.raises(EagletError, match=r"^f: no engine 'tgi' \(engines: transformers, "):
        lookup.engine("tgi", "generate", "f")
    path.write_text(yaml.safe_dump({**data, "hidden": {"backend": "openai"}}))
    with pytest.raises(EagletError, match=r"hidden\.backend: 'openai' is not one of"):
        load(path)  # in a file, the schema already says so
