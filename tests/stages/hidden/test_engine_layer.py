"""The engine layer: what each engine can do, the one lookup the stages use, and the SGLang
hidden-states client on the one HTTP client and retry policy (real loopback servers)."""

from __future__ import annotations

import pytest
import torch
import yaml

from eaglet.engines import lookup
from eaglet.engines.sglang import SGLangHidden
from eaglet.errors import EagletError
from eaglet.params import load

from ...hidden_fixture import TINY, sgl_ids, tiny_llama
from ...sglang_server import SGLangServer


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
    with pytest.raises(EagletError) as e:  # a kind the schema keeps out of a params file
        lookup.hidden_states("openai", {}, target=None, layer_ids=[1])
    assert str(e.value) == "hidden.backend: openai cannot give hidden states (it can: generate)"
    with pytest.raises(EagletError, match=r"^f: sglang cannot decode with a drafter \(it can: "):
        lookup.engine("sglang", "speculate", "f")
    with pytest.raises(EagletError, match=r"^f: no engine 'tgi' \(engines: transformers, "):
        lookup.engine("tgi", "generate", "f")
    path.write_text(yaml.safe_dump({**data, "hidden": {"backend": "openai"}}))
    with pytest.raises(EagletError, match=r"hidden\.backend: 'openai' is not one of"):
        load(path)  # in a file, the schema already says so


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(2)
    return tiny_llama()


def hidden_cfg(aux: SGLangServer, full: SGLangServer, max_retries: int) -> dict:
    """`hidden` as params.yaml gives it (its defaults but the retries)."""
    return {
        "url": aux.url,
        "last_url": full.url,
        "concurrency": 2,
        "timeout_s": 30,
        "max_retries": max_retries,
    }


def test_sglang_hidden_states_retry_through_the_one_http_policy(tiny):
    """A dropped connection, a cut-off 200 and a 503 are retried (the cut-off 200 crashed the
    SGLang client's own retry loop), and the states are exactly the server's forward."""
    layers = sgl_ids(TINY["num_hidden_layers"])
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with (
        SGLangServer(tiny, "aux", layers, faults=["drop", "truncated"]) as aux,
        SGLangServer(tiny, "full", layers, faults=["503"]) as full,
    ):
        client = SGLangHidden(hidden_cfg(aux, full, 2), TINY["hidden_size"], len(layers))
        [states] = client.run([seqs])
    assert aux.requests == 3 and full.requests == 2  # one batch each, after its faults
    for ids, (a, last) in zip(seqs, states, strict=True):
        with torch.inference_mode():
            hs = tiny(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert torch.equal(a, torch.stack([hs[i + 1][0] for i in layers], dim=1))
        assert torch.equal(last, hs[-1][0])


def test_sglang_hidden_states_stop_once_hidden_max_retries_is_spent(tiny):
    layers = sgl_ids(TINY["num_hidden_layers"])
    with (
        SGLangServer(tiny, "aux", layers, faults=["503"] * 3) as aux,
        SGLangServer(tiny, "full", layers) as full,
    ):
        client = SGLangHidden(hidden_cfg(aux, full, 1), TINY["hidden_size"], len(layers))
        with pytest.raises(EagletError) as e:
            client.run([[[5, 6, 7]]])
    assert str(e.value) == f"{aux.url}/generate: HTTP 503: busy (after 2 attempts)"
    assert aux.requests == 2 and full.requests == 0
