"""eaglet.formats.metrics: metrics.json and the evaluate sidecar's stats read as typed records and
written back byte for byte; a damaged file is one line naming the file and the field.

The fixtures are a built demo's files (metrics.json of `make demo`, the stats of its sidecar),
cut to one suite as built and one of a thinking mode decoded by eaglet alone."""

from __future__ import annotations

import json

import pytest

from eaglet.errors import EagletError
from eaglet.formats.io import read_json, write_json
from eaglet.formats.metrics import (
    Startup,
    read_metrics,
    summary_json,
    summary_of,
    write_metrics,
)

from ..conftest import FIXTURES

METRICS = FIXTURES / "metrics" / "metrics.json"
STATS = FIXTURES / "metrics" / "stats.json"


def _round_trip(path, tmp_path) -> bytes:
    out = tmp_path / "back.json"
    write_metrics(out, read_metrics(path))
    return out.read_bytes()


def test_metrics_read_and_written_back_are_the_same_bytes(tmp_path):
    assert _round_trip(METRICS, tmp_path) == METRICS.read_bytes()


def test_the_records_hold_the_files_numbers():
    m = read_metrics(METRICS)
    assert m.engine.startup == Startup(45.68, {3: 47.66}) and not m.engine.operator
    assert m.temperatures == (0, 0.7) and m.offline[3].positions == 4090
    h = m.suites["humaneval"]
    greedy, sampled = h.vllm[0][3], h.vllm[0.7][3]
    assert greedy.greedy.greedy_equal and greedy.counters.drafts == 572
    assert sampled.greedy is None and sampled.counters.accepted_tokens == 151
    own = h.eaglet[0][3]
    assert own.rounds.rounds == 572 and own.counters is None and own.greedy.speedup is None
    assert h.agreement[3].difference == 0.0
    think = m.suites["natural/think"]
    assert think.mode == "think" and think.vllm is None and think.agreement is None
    assert isinstance(think.eaglet[0][3].acceptance_length, float)  # 1.0 stays 1.0


def test_an_operators_engine_round_trips(tmp_path):
    """An engine already serving the drafter: no startup, no greedy reference, no plain run."""
    obj = read_json(METRICS)
    obj["engine"] = {"concurrency": 4, "engine": "vllm", "operator": True}
    obj["greedy_reference"] = None
    suite = obj["suites"]["humaneval"]
    suite["vllm_greedy_tokens_per_s"] = None
    for field in ("greedy_equal", "greedy_mismatches", "greedy_tokens_per_s", "speedup"):
        del suite["vllm"]["temperature_0"]["num_steps_3"][field]
    del suite["agreement"]
    path = tmp_path / "operator.json"
    write_json(path, obj)
    assert _round_trip(path, tmp_path) == path.read_bytes()
    m = read_metrics(path)
    assert m.engine.operator and m.suites["humaneval"].vllm[0][3].greedy is None


def test_the_summary_read_and_written_back_is_the_same(tmp_path):
    stats = read_json(STATS)
    s = summary_of(stats, str(STATS))
    assert s.suites["humaneval"].vllm[0.7] == {3: 1.263525305410122}
    assert s.suites["natural/think"].vllm == {} and s.offline_acceptance_length == {
        3: 1.3970659971237183
    }
    assert summary_json(s) == stats
    dflash = summary_json(s.dflash(3, "a note"))
    assert (dflash["method"], dflash["num_steps"], dflash["note"]) == ("dflash", 3, "a note")
    assert summary_of(dflash, "x").dflash(3, "a note") == summary_of(dflash, "x")


def _damaged(tmp_path, edit) -> str:
    obj = read_json(METRICS)
    edit(obj)
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(EagletError) as e:
        read_metrics(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


RUN = ("suites", "humaneval", "vllm", "temperature_0", "num_steps_3")


def _at(obj: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        obj = obj[key]
    return obj


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda o: o.pop("drafter"), "drafter: missing"),
        (lambda o: o.update(prompts="24"), "prompts: expected an integer, got '24'"),
        (
            lambda o: _at(o, RUN).update(acceptance_rate=[0.2, "x"]),
            "suites.humaneval.vllm.temperature_0.num_steps_3.acceptance_rate: expected a list of "
            "numbers, got [0.2, 'x']",
        ),
        (
            lambda o: _at(o, RUN).pop("drafts"),
            "suites.humaneval.vllm.temperature_0.num_steps_3.drafts: missing",
        ),
        (
            lambda o: _at(o, RUN).update(extra=1),
            "suites.humaneval.vllm.temperature_0.num_steps_3.extra: unknown field",
        ),
        (
            lambda o: _at(o, RUN[:-1]).update(num_steps_03=_at(o, RUN)),
            "suites.humaneval.vllm.temperature_0.num_steps_03: not a num_steps_<k> name",
        ),
        (
            lambda o: _at(o, RUN[:3]).update({"temperature_0.70": {}}),
            "suites.humaneval.vllm.temperature_0.70: not a temperature_<t> name",
        ),
        (
            lambda o: _at(o, ("suites", "humaneval", "eaglet")).update(_at(o, RUN[:3])),
            "suites.humaneval.eaglet.temperature_0.num_steps_3: not a run of eaglet",
        ),
        (lambda o: o.update(engine=[]), "engine: expected an object, got []"),
        (lambda o: o["engine"].pop("startup_s"), "engine.startup_s: missing"),
        (lambda o: o.update(suites={"q": 1}), "suites.q: expected an object, got 1"),
        (lambda o: o.update(extra=1), "extra: unknown field"),
    ],
)
def test_a_damaged_metrics_file_is_one_line_naming_the_field(tmp_path, edit, said):
    assert _damaged(tmp_path, edit) == said


def test_an_unreadable_metrics_file_is_one_line(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text('{"drafter": ')
    with pytest.raises(EagletError, match=r"metrics.json: cannot read \(Expecting value"):
        read_metrics(path)
    with pytest.raises(EagletError, match="the top level: expected an object, got \\[\\]"):
        path.write_text("[]")
        read_metrics(path)


def test_damaged_stats_name_the_sidecar_and_the_field():
    stats = read_json(STATS)
    stats["suites"]["humaneval"]["vllm_temperature_x"] = {"num_steps_3": 1.2}
    with pytest.raises(EagletError) as e:
        summary_of(stats, "demo.json")
    assert str(e.value) == (
        "demo.json: stats.suites.humaneval.vllm_temperature_x: not a vllm_temperature_<t> name"
    )
    stats = read_json(STATS)
    stats["suites"]["humaneval"]["greedy_equal"]["num_steps_3"] = "yes"
    with pytest.raises(EagletError, match=r"greedy_equal.num_steps_3: expected true or false"):
        summary_of(stats, "demo.json")
