"""The evaluate stage for a DFlash drafter around the engine: its plots (engine-only metrics,
training metrics.csv with DFlash's acc_1.. columns; EAGLE-3's start at acc_0) and its run
(metrics.json and the sidecar)."""

from eaglet.formats.dflash import save_dflash
from eaglet.formats.metrics import (
    Counters,
    EngineInfo,
    Greedy,
    Metrics,
    Run,
    Startup,
    Suite,
    read_metrics,
)
from eaglet.stages.evaluate import run as evaluate_run

# the engine's greedy run of a DFlash drafter of block_size 4: num_steps 3
RUN = Run(
    1.8,
    (0.5, 0.4, 0.2),
    18,
    9.0,
    Greedy(True, 0, 10.0, 0.9),
    counters=Counters((0.5,), 10, 30, 8, 18),
)
SUITE = Suite(
    prompts=2, source="q.jsonl", eaglet={}, vllm={0: {3: RUN}}, vllm_greedy_tokens_per_s=10.0
)


def test_plots_take_dflash_metrics(tmp_path):
    metrics = Metrics(
        drafter="d",
        prompts=2,
        temperatures=(0,),
        greedy_reference="vllm",
        in_process=False,
        suites={"q": SUITE},
        offline={},
        engine=EngineInfo("vllm", 1),
        notes={},
        elapsed_s=1.0,
    )
    rows = [
        {"step": str(s), "loss": "2.0", "lr": "1e-3", "grad_norm": "1", "acc_1": "0.5",
         "acc_2": "0.3", "acc_3": "0.1"}
        for s in range(3)
    ]  # fmt: skip
    evaluate_run.plot(metrics, rows, tmp_path)
    assert all((tmp_path / f).stat().st_size for f in ("acceptance.png", "suites.png", "loss.png"))


def test_the_stage_writes_a_dflash_drafters_engine_metrics(tmp_path, monkeypatch):
    """evaluate_run.run on a trained DFlash folder (the engine's measures stubbed): no drafter or
    target loaded, no offline estimate, metrics.json and the sidecar say method dflash and its
    one num_steps, block_size - 1; engine: none is refused in one line."""
    import json
    from dataclasses import replace
    from types import SimpleNamespace

    import pytest

    from eaglet.errors import EagletError
    from eaglet.model.dflash.config import DFlashConfig
    from eaglet.model.dflash.train import Hyper, fit, init

    from ...hidden_fixture import TINY, bundle, evaluate_settings

    data = bundle(n=3, new_tokens=8)
    cfg = DFlashConfig.from_target(TINY, target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=4)
    model = init(cfg, data["embed"], data["lm_head"], None)
    trained = tmp_path / "trained"
    save_dflash(model, trained, fit(model, data["samples"], Hyper(steps=2, batch_size=3)))
    seen = {}
    engine = EngineInfo("vllm", 1, "float32", True, Startup(1.0, {3: 1.0}))

    def measured(spec, setup, model, target_model, readers, held):
        seen.update(model=model, target=target_model)
        return {"q": SUITE}, engine

    monkeypatch.setattr(evaluate_run.hidden_read, "open_readers", lambda states: [])
    monkeypatch.setattr(evaluate_run.hidden_read, "split", lambda readers, f: ([], []))
    monkeypatch.setattr(evaluate_run.hidden_read, "close_readers", lambda readers: None)
    monkeypatch.setattr(evaluate_run, "measure_suites", measured)
    settings = evaluate_settings(num_steps=(3, 7), in_process=True)
    spec = SimpleNamespace(
        name="d",
        values=SimpleNamespace(settings=settings, heldout_fraction=0.1),
        provenance=lambda: {"stage": "test"},
    )
    setup = SimpleNamespace(trained=trained, states=None, engine_url="http://engine")
    out = evaluate_run.run(spec, setup, tmp_path / "out")
    metrics = json.loads((out / "metrics.json").read_text())
    assert seen == {"model": None, "target": None}
    assert metrics["method"] == "dflash" and metrics["offline"] == {}
    assert not metrics["in_process"] and "dflash" in metrics["notes"]
    assert metrics["suites"]["q"]["vllm"]["temperature_0"]["num_steps_3"]["drafts"] == 10
    typed = read_metrics(out / "metrics.json")
    assert typed.suites == {"q": SUITE} and typed.engine == engine
    assert (typed.method, typed.greedy_reference) == ("dflash", "vllm")
    stats = json.loads(evaluate_run.sidecar_of(out).read_text())["stats"]
    assert (stats["method"], stats["num_steps"], stats["acceptance_length"]) == ("dflash", 3, 1.8)
    spec.values.settings = replace(settings, engine="none")
    with pytest.raises(EagletError, match="engine: vllm"):
        evaluate_run.run(spec, setup, tmp_path / "none")
