"""The evaluate stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from eaglet.device import device_type
from eaglet.errors import AwaitedFile, EagletError
from eaglet.graph.footprint import in_process, in_process_bytes
from eaglet.graph.keys import Keys, file_key
from eaglet.hashing import file_digest

if TYPE_CHECKING:
    from eaglet.model.target import TargetSpec
    from eaglet.stages.evaluate.suites import Suite
    from eaglet.stages.hidden.read import States


@dataclass(frozen=True)
class SuiteDigest:
    """An evaluation suite as the key holds it: its file's bytes, not where it lies."""

    sha256: str
    format: str
    prompts: int  # how many of its prompts are decoded


@dataclass(frozen=True)
class EvaluateSettings:
    """drafters.<d>.evaluate resolved (`EvaluateSpec.evaluate`), typed: what the run reads. A
    field the dict leaves out is None."""

    num_steps: tuple[int, ...]
    prompts: int
    temperatures: tuple[float, ...]
    seed: int
    max_new_tokens: int
    dtype: str
    device: str  # the resolved device type
    engine: str  # none or vllm
    engine_concurrency: int
    engine_eager: bool
    engine_tensor_parallel_size: int
    engine_extra_args: tuple[str, ...]
    in_process: bool  # resolved: eaglet's own decoder loads the target here
    suites: dict[str, SuiteDigest] | None = None  # None: the drafter's own held-out split
    modes: tuple[str, ...] | None = None
    thinking_switch: str | None = None  # the template argument the modes set
    engine_operator: bool | None = None  # True: an operator's engine (engine_url) serves it

    @classmethod
    def of(cls, evaluate: dict) -> EvaluateSettings:
        typed = {k: tuple(v) if isinstance(v, list) else v for k, v in evaluate.items()}
        if "suites" in typed:
            typed["suites"] = {n: SuiteDigest(**s) for n, s in typed["suites"].items()}
        return cls(**typed)


@dataclass(frozen=True)
class EvaluateSpec:
    """What the metrics depend on (and the drafter, its export and the states upstream)."""

    # drafters.<d>.evaluate resolved: device type, in_process, suites' digests; the key hashes
    # this dict as it is, the run reads it typed (`settings`)
    evaluate: dict
    heldout_fraction: float
    target: dict

    @cached_property
    def settings(self) -> EvaluateSettings:
        return EvaluateSettings.of(self.evaluate)


def spec_of(keys: Keys, drafter: str) -> tuple[EvaluateSpec, dict]:
    d = keys.params.drafter(drafter)
    text, where, _ = keys.target_text_config()
    evaluate = dict(d["evaluate"], device=device_type(d["evaluate"]["device"]))
    evaluate["in_process"] = in_process(d["evaluate"], text)
    if not evaluate["in_process"] and evaluate["engine"] == "none":
        raise EagletError(
            f"drafters.{drafter}.evaluate: the target ({where}) does not fit in this machine's "
            f"memory in {evaluate['dtype']} ({in_process_bytes(text, evaluate['dtype']) / 1e9:.0f}"
            " GB): set engine: vllm (evaluation on the serving engine), or in_process: true"
        )
    if evaluate.get("modes"):  # the template argument each mode's prompts are rendered with
        evaluate["thinking_switch"] = keys.params.target["thinking_switch"]
    if evaluate.pop("engine_url", None):  # where it listens is plumbing, whose engine is not
        evaluate["engine_operator"] = True
    if "suites" in evaluate:  # each file's bytes, not where it lies
        evaluate["suites"] = {
            name: {
                "sha256": _suite_digest(keys, s, f"drafters.{drafter}.evaluate.suites.{name}"),
                "format": s["format"],
                "prompts": s.get("prompts", evaluate["prompts"]),
            }
            for name, s in evaluate["suites"].items()
        }
    spec = EvaluateSpec(evaluate, d["heldout_fraction"], keys.target_identity())
    upstream = {"train": keys.key("train", drafter), "hidden": keys.dataset_keys("hidden", drafter)}
    if evaluate["engine"] != "none":  # the engine serves the drafter's vLLM export
        upstream["vllm"] = keys.key("vllm", drafter)
    return spec, upstream


def _suite_digest(keys: Keys, suite: dict, where: str) -> str:
    """SHA-256 of an evaluation suite's file (HumanEval's: the installed package's)."""
    from eaglet.formats.datasets import humaneval_path

    if "path" in suite:
        if not keys.params.resolve(suite["path"]).exists():  # only this stage reads it
            raise AwaitedFile(
                f"{keys.params.path}: {where}.path: {suite['path']}: no such file (the evaluate "
                "stage waits for it)",
                suite["path"],
                f"{where}.path",
            )
        return file_key(keys.params, suite["path"], where)
    return file_digest(humaneval_path())


@dataclass(frozen=True)
class Setup:
    """Beside the spec: where things are and how the run is placed; changes no output byte."""

    states: States
    trained: Path
    export: Path  # the vLLM export an eaglet-started engine serves
    target: TargetSpec  # where its files are (its identity is in the spec)
    suites: tuple[Suite, ...]
    device: str  # as configured, e.g. cuda:1 (the spec holds its type)
    target_max_length: int  # the engine's context floor
    engine_url: str | None = None  # an operator's engine serving the drafter
    threads: int | None = None
    quiet: bool = False
