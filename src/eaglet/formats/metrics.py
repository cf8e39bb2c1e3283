"""The evaluate stage's numbers as typed records: metrics.json (every speculative run of every
suite: per decoder, temperature and num_steps) and the summary its sidecar holds as `stats` (the
headline numbers that status and compare show and publish copies), each with one writer and one
reader.

In the files a temperature names its results `temperature_<t:g>` and a draft length
`num_steps_<k>`; those names are built and parsed here only. The writers give the bytes the
stage has always written (pretty sorted JSON, eaglet.formats.io.write_json), so a file read and
written back is the same file. The readers check the structure as they read: a damaged file, a
missing, unknown or mistyped field, is one EagletError naming the file and the field.

JSON numbers are kept as read (an int stays an int), so that a number's bytes round-trip too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from eaglet.errors import EagletError
from eaglet.formats.io import read_json, write_json

Number = int | float


def temperature_key(t: float) -> str:
    """How a temperature names its results: temperature_0, temperature_0.7."""
    return f"temperature_{t:g}"


def steps_key(n: int) -> str:
    """How a draft length names its results: num_steps_3."""
    return f"num_steps_{n}"


# -- the records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Greedy:
    """A greedy run checked against plain greedy decoding of the same prompts: how many outputs
    differ, and the plain run's speed (None where the reference was decoded elsewhere)."""

    greedy_equal: bool
    greedy_mismatches: int
    greedy_tokens_per_s: float | None
    speedup: float | None


@dataclass(frozen=True)
class Rounds:
    """What eaglet's own decoder counts: verification rounds, and 1 + accepted drafts / rounds
    (the engine's measure, with no prefill token)."""

    mean_acceptance_length: float | None
    rounds: int


@dataclass(frozen=True)
class Counters:
    """An engine's speculative-decoding counters over the run (deltas of vLLM's /metrics)."""

    accepted_per_position: tuple[float, ...]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    generation_tokens: int


@dataclass(frozen=True)
class Run:
    """One speculative run: one decoder on one suite at one temperature and num_steps."""

    acceptance_length: float | None
    acceptance_rate: tuple[float, ...]  # per draft position, given the ones before it
    generated_tokens: int
    tokens_per_s: float
    greedy: Greedy | None = None  # greedy runs with a plain greedy reference
    rounds: Rounds | None = None  # eaglet's decoder
    counters: Counters | None = None  # the engine's


# {temperature: {num_steps: Run}}, in the order they were measured (a file's: its sorted order)
Runs = dict[float, dict[int, Run]]


@dataclass(frozen=True)
class Offline:
    """The teacher-forced estimate at one num_steps over the held-out split."""

    acceptance_length: float | None
    acceptance_rate: tuple[float, ...]
    positions: int


@dataclass(frozen=True)
class Agreement:
    """The engine's greedy acceptance next to eaglet's, the same quantity on the same prompts."""

    engine: float | None
    eaglet: float | None
    difference: float | None
    eaglet_greedy_equal: bool
    engine_greedy_equal: bool


@dataclass(frozen=True)
class Suite:
    """One suite's runs: eaglet's own (empty when it did not decode) and the engine's (None when
    none ran), each {temperature: {num_steps: Run}}."""

    prompts: int
    source: str
    eaglet: Runs
    vllm: Runs | None = None
    vllm_greedy_tokens_per_s: float | None = None  # with vllm: None on an operator's engine
    agreement: dict[int, Agreement] | None = None  # {num_steps: ...}, greedy, both decoded
    mode: str | None = None  # a thinking mode's suite, `<suite>/<mode>`


@dataclass(frozen=True)
class Startup:
    """Seconds each engine took to start: the plain one, and one per num_steps."""

    plain: float
    by_steps: dict[int, float]


@dataclass(frozen=True)
class EngineInfo:
    """The engine that measured: one eaglet started (`startup` set), or an operator's already
    serving the drafter (`startup` None: no plain run, so no greedy reference)."""

    engine: str
    concurrency: int
    dtype: str | None = None
    enforce_eager: bool | None = None
    startup: Startup | None = None

    @property
    def operator(self) -> bool:
        return self.startup is None


@dataclass(frozen=True)
class Metrics:
    """metrics.json: the whole evaluation of a drafter."""

    drafter: str
    prompts: int
    temperatures: tuple[Number, ...]
    greedy_reference: str | None
    in_process: bool
    suites: dict[str, Suite]
    offline: dict[int, Offline]
    engine: EngineInfo | None
    notes: dict[str, str]
    elapsed_s: float
    method: str | None = None  # "dflash"; an EAGLE-3 drafter's file has no such field


@dataclass(frozen=True)
class SuiteSummary:
    """One suite in the summary: acceptance length per decoder, temperature and num_steps, and
    eaglet's greedy equality per num_steps."""

    prompts: int
    eaglet: dict[float, dict[int, float | None]]
    vllm: dict[float, dict[int, float | None]]
    greedy_equal: dict[int, bool]


@dataclass(frozen=True)
class Summary:
    """The sidecar's stats: the headline acceptance length and who measured it, per suite."""

    prompts: int
    acceptance_length: float | None
    acceptance_length_by: str
    suites: dict[str, SuiteSummary]
    offline_acceptance_length: dict[int, float | None]
    method: str | None = None  # "dflash": its one num_steps, and the note
    num_steps: int | None = None
    note: str | None = None

    def dflash(self, num_steps: int, note: str) -> Summary:
        return replace(self, method="dflash", num_steps=num_steps, note=note)


# -- the fields in the files -----------------------------------------------------------------

# A run's fields beyond its first four come in groups: each group all there or all absent.
_GROUPS = {
    "greedy": ("greedy_equal", "greedy_mismatches", "greedy_tokens_per_s", "speedup"),
    "rounds": ("mean_acceptance_length", "rounds"),
    "counters": (
        "accepted_per_position",
        "drafts",
        "draft_tokens",
        "accepted_tokens",
        "generation_tokens",
    ),
}
_RECORDS = {"greedy": Greedy, "rounds": Rounds, "counters": Counters}
_RUN = ("acceptance_length", "acceptance_rate", "generated_tokens", "tokens_per_s")
_AGREEMENT = ("engine", "eaglet", "difference", "eaglet_greedy_equal", "engine_greedy_equal")
_OFFLINE = ("acceptance_length", "acceptance_rate", "positions")


# -- the writers ------------------------------------------------------------------------------


def _fields(record: Any, names: tuple[str, ...]) -> dict:
    out = {}
    for name in names:
        v = getattr(record, name)
        out[name] = list(v) if isinstance(v, tuple) else v
    return out


def run_json(r: Run) -> dict:
    out = _fields(r, _RUN)
    for group, names in _GROUPS.items():
        if (g := getattr(r, group)) is not None:
            out |= _fields(g, names)
    return out


def _by_temperature(runs: dict, value: Callable = run_json) -> dict:
    return {
        temperature_key(t): {steps_key(n): value(r) for n, r in by_steps.items()}
        for t, by_steps in runs.items()
    }


def suite_json(s: Suite) -> dict:
    out: dict = {"prompts": s.prompts, "source": s.source, "eaglet": _by_temperature(s.eaglet)}
    if s.mode is not None:
        out["mode"] = s.mode
    if s.vllm is not None:
        out["vllm_greedy_tokens_per_s"] = s.vllm_greedy_tokens_per_s
        out["vllm"] = _by_temperature(s.vllm)
    if s.agreement is not None:
        out["agreement"] = {steps_key(n): _fields(a, _AGREEMENT) for n, a in s.agreement.items()}
    return out


def offline_json(o: Offline) -> dict:
    return _fields(o, _OFFLINE)


def engine_json(e: EngineInfo) -> dict:
    out: dict = {"engine": e.engine, "concurrency": e.concurrency}
    if e.startup is None:
        return out | {"operator": True}
    startup = {"plain": e.startup.plain} | {steps_key(n): s for n, s in e.startup.by_steps.items()}
    return out | {"dtype": e.dtype, "enforce_eager": e.enforce_eager, "startup_s": startup}


def metrics_json(m: Metrics) -> dict:
    out = {
        "drafter": m.drafter,
        "prompts": m.prompts,
        "temperatures": list(m.temperatures),
        "greedy_reference": m.greedy_reference,
        "in_process": m.in_process,
        "suites": {name: suite_json(s) for name, s in m.suites.items()},
        "offline": {steps_key(n): offline_json(o) for n, o in m.offline.items()},
        "engine": engine_json(m.engine) if m.engine is not None else None,
        "notes": dict(m.notes),
        "elapsed_s": m.elapsed_s,
    }
    if m.method is not None:
        out["method"] = m.method
    return out


def write_metrics(path: str | os.PathLike, m: Metrics) -> None:
    """Write metrics.json (atomically, pretty sorted JSON)."""
    write_json(path, metrics_json(m))


def summary_json(s: Summary) -> dict:
    """The sidecar's `stats`."""
    suites = {}
    for name, x in s.suites.items():
        row: dict = {"prompts": x.prompts}
        row |= {f"vllm_{k}": v for k, v in _by_temperature(x.vllm, _as_is).items()}
        row |= {f"eaglet_{k}": v for k, v in _by_temperature(x.eaglet, _as_is).items()}
        row["greedy_equal"] = {steps_key(n): v for n, v in x.greedy_equal.items()}
        suites[name] = row
    out = {
        "prompts": s.prompts,
        "acceptance_length": s.acceptance_length,
        "acceptance_length_by": s.acceptance_length_by,
        "suites": suites,
        "offline_acceptance_length": {
            steps_key(n): v for n, v in s.offline_acceptance_length.items()
        },
    }
    if s.method is not None:
        out |= {"method": s.method, "num_steps": s.num_steps, "note": s.note}
    return out


def _as_is(v: Any) -> Any:
    return v


# -- the readers ------------------------------------------------------------------------------

NUMBER, INTEGER, BOOL, TEXT, NUMBERS = (
    "a number",
    "an integer",
    "true or false",
    "a string",
    "a list of numbers",
)
# The kind of each field of the flat records (Run and its groups, Agreement, Offline), and
# whether it may be null.
_KIND = {
    "acceptance_length": (NUMBER, True),
    "acceptance_rate": (NUMBERS, False),
    "generated_tokens": (INTEGER, False),
    "tokens_per_s": (NUMBER, False),
    "greedy_equal": (BOOL, False),
    "greedy_mismatches": (INTEGER, False),
    "greedy_tokens_per_s": (NUMBER, True),
    "speedup": (NUMBER, True),
    "mean_acceptance_length": (NUMBER, True),
    "rounds": (INTEGER, False),
    "accepted_per_position": (NUMBERS, False),
    "drafts": (INTEGER, False),
    "draft_tokens": (INTEGER, False),
    "accepted_tokens": (INTEGER, False),
    "generation_tokens": (INTEGER, False),
    "engine": (NUMBER, True),
    "eaglet": (NUMBER, True),
    "difference": (NUMBER, True),
    "eaglet_greedy_equal": (BOOL, False),
    "engine_greedy_equal": (BOOL, False),
    "positions": (INTEGER, False),
}
_TEMPERATURE = re.compile(r"temperature_(.+)")
_STEPS = re.compile(r"num_steps_([1-9][0-9]*)")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_IS: dict[str, Callable[[Any], bool]] = {
    NUMBER: _is_number,
    INTEGER: lambda v: isinstance(v, int) and not isinstance(v, bool),
    BOOL: lambda v: isinstance(v, bool),
    TEXT: lambda v: isinstance(v, str),
    NUMBERS: lambda v: isinstance(v, list) and all(_is_number(x) for x in v),
}


class _Object:
    """A JSON object being read, at `path` in the file `where`: each field taken and checked,
    and at `done` none left over (a field no record knows is damage too: it would not be
    written back)."""

    def __init__(self, obj: Any, where: str, path: str):
        self.where, self.path = where, path
        if not isinstance(obj, dict):
            raise self.damaged("", f"expected an object, got {_shown(obj)}")
        self.obj, self.taken = obj, set()

    def damaged(self, key: str, problem: str) -> EagletError:
        field = ".".join(p for p in (self.path, key) if p) or "the top level"
        return EagletError(f"{self.where}: {field}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.obj

    def take(self, key: str, kind: str, null: bool = False) -> Any:
        """The field `key`, of `kind`, or None where `null` allows it; a list as a tuple."""
        if key not in self.obj:
            raise self.damaged(key, "missing")
        self.taken.add(key)
        v = self.obj[key]
        if (v is None and null) or (v is not None and _IS[kind](v)):
            return tuple(v) if isinstance(v, list) else v
        raise self.damaged(key, f"expected {kind}{' or null' if null else ''}, got {_shown(v)}")

    def child(self, key: str) -> _Object:
        if key not in self.obj:
            raise self.damaged(key, "missing")
        self.taken.add(key)
        return _Object(self.obj[key], self.where, ".".join(p for p in (self.path, key) if p))

    def child_or_null(self, key: str) -> _Object | None:
        if key in self.obj and self.obj[key] is None:
            self.taken.add(key)
            return None
        return self.child(key)

    def left(self) -> list[str]:
        """The fields not taken yet, in the file's order: a map's keys."""
        return [k for k in self.obj if k not in self.taken]

    def done(self) -> None:
        if left := self.left():
            raise self.damaged(left[0], "unknown field")


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _steps(o: _Object, key: str) -> int:
    m = _STEPS.fullmatch(key)
    if not m:
        raise o.damaged(key, "not a num_steps_<k> name")
    return int(m.group(1))


def _temperature(o: _Object, key: str, prefix: str = "") -> float:
    """The temperature `key` names (after `prefix`); a name that would not be written back the
    same (temperature_0.70) is damage."""
    m = _TEMPERATURE.fullmatch(key.removeprefix(prefix))
    try:
        t = float(m.group(1)) if m else None
    except ValueError:
        t = None
    if t is None or prefix + temperature_key(t) != key:
        raise o.damaged(key, f"not a {prefix}temperature_<t> name")
    return t


def _flat(o: _Object, record: type, names: tuple[str, ...]) -> Any:
    out = record(*(o.take(n, *_KIND[n]) for n in names))
    o.done()
    return out


def _group(o: _Object, record: type, names: tuple[str, ...]) -> Any:
    """The record of `names` if any of them is there (then all must be), else None."""
    if not any(o.has(n) for n in names):
        return None
    return record(*(o.take(n, *_KIND[n]) for n in names))


def _run(o: _Object) -> Run:
    fields = [o.take(n, *_KIND[n]) for n in _RUN]
    groups = {g: _group(o, _RECORDS[g], names) for g, names in _GROUPS.items()}
    o.done()
    return Run(*fields, **groups)


def run_of(obj: Any, where: str) -> Run:
    """A run from its JSON object (a file's, or a measure's dict), checked."""
    return _run(_Object(obj, where, ""))


def _by_steps(o: _Object, value: Callable[[_Object, str], Any]) -> dict:
    out = {_steps(o, k): value(o, k) for k in o.left()}
    o.done()
    return out


def _runs(o: _Object, who: str) -> Runs:
    """{temperature: {num_steps: Run}}; eaglet's runs count rounds, an engine's its counters."""
    out: Runs = {}
    for tkey in o.left():
        by_steps = o.child(tkey)
        out[_temperature(o, tkey)] = runs = {}
        for nkey in by_steps.left():
            r = _run(by_steps.child(nkey))
            if (r.rounds is None) != (who == "vllm") or (r.counters is None) != (who == "eaglet"):
                raise by_steps.damaged(nkey, f"not a run of {who}")
            runs[_steps(by_steps, nkey)] = r
    return out


def _suite(o: _Object) -> Suite:
    prompts, source = o.take("prompts", INTEGER), o.take("source", TEXT)
    mode = o.take("mode", TEXT) if o.has("mode") else None
    eaglet = _runs(o.child("eaglet"), "eaglet")
    vllm = tps = agreement = None
    if o.has("vllm"):
        tps = o.take("vllm_greedy_tokens_per_s", NUMBER, null=True)
        vllm = _runs(o.child("vllm"), "vllm")
    if o.has("agreement"):
        a = o.child("agreement")
        agreement = _by_steps(a, lambda a, k: _flat(a.child(k), Agreement, _AGREEMENT))
    o.done()
    return Suite(prompts, source, eaglet, vllm, tps, agreement, mode)


def _engine(o: _Object) -> EngineInfo:
    engine, conc = o.take("engine", TEXT), o.take("concurrency", INTEGER)
    if o.has("operator"):
        if o.take("operator", BOOL) is not True:
            raise o.damaged("operator", "expected true")
        o.done()
        return EngineInfo(engine, conc)
    dtype, eager = o.take("dtype", TEXT), o.take("enforce_eager", BOOL)
    s = o.child("startup_s")
    plain = s.take("plain", NUMBER)
    by_steps = _by_steps(s, lambda s, k: s.take(k, NUMBER))
    o.done()
    return EngineInfo(engine, conc, dtype, eager, Startup(plain, by_steps))


def metrics_of(obj: Any, where: str) -> Metrics:
    """metrics.json's records from its JSON, checked (`where`: the file, for the errors)."""
    o = _Object(obj, where, "")
    head = (
        o.take("drafter", TEXT),
        o.take("prompts", INTEGER),
        o.take("temperatures", NUMBERS),
        o.take("greedy_reference", TEXT, null=True),
        o.take("in_process", BOOL),
    )
    s = o.child("suites")
    suites = {name: _suite(s.child(name)) for name in s.left()}
    off = o.child("offline")
    offline = _by_steps(off, lambda off, k: _flat(off.child(k), Offline, _OFFLINE))
    e = o.child_or_null("engine")
    engine = _engine(e) if e is not None else None
    n = o.child("notes")
    notes = {k: n.take(k, TEXT) for k in n.left()}
    elapsed = o.take("elapsed_s", NUMBER)
    method = o.take("method", TEXT) if o.has("method") else None
    o.done()
    return Metrics(*head, suites, offline, engine, notes, elapsed, method)


def read_metrics(path: str | os.PathLike) -> Metrics:
    """metrics.json, checked: a damaged file is one EagletError naming it and the field."""
    try:
        obj = read_json(path)
    except (OSError, ValueError) as e:
        raise EagletError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    return metrics_of(obj, str(path))


def _values(o: _Object, kind: str, null: bool) -> dict:
    return _by_steps(o, lambda o, k: o.take(k, kind, null))


def _suite_summary(o: _Object) -> SuiteSummary:
    prompts = o.take("prompts", INTEGER)
    greedy = _values(o.child("greedy_equal"), BOOL, False)
    by: dict[str, dict] = {"eaglet": {}, "vllm": {}}
    for key in o.left():
        who = key.partition("_")[0]
        if who not in by:
            continue
        by[who][_temperature(o, key, f"{who}_")] = _values(o.child(key), NUMBER, True)
    o.done()
    return SuiteSummary(prompts, by["eaglet"], by["vllm"], greedy)


def summary_of(stats: Any, where: str) -> Summary:
    """The sidecar's stats as a Summary, checked (`where`: the sidecar, for the errors)."""
    o = _Object(stats, where, "stats")
    head = (
        o.take("prompts", INTEGER),
        o.take("acceptance_length", NUMBER, null=True),
        o.take("acceptance_length_by", TEXT),
    )
    s = o.child("suites")
    suites = {name: _suite_summary(s.child(name)) for name in s.left()}
    offline = _values(o.child("offline_acceptance_length"), NUMBER, True)
    dflash: tuple = ()
    if o.has("method"):
        dflash = (
            o.take("method", TEXT),
            o.take("num_steps", INTEGER),
            o.take("note", TEXT),
        )
    o.done()
    return Summary(*head, suites, offline, *dflash)
