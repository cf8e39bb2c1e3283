"""Content keys and keyed paths: the one place that says where each artifact lives.

A stage's artifact is resolved once, here, into a `Spec`: the stage's values (its slice of
params with everything resolved: device, dtype, a hub target's commit, layer ids, the drafter's
arch; never `auto` or a moving ref) and the keys of its upstream artifacts. The stage's `run`
reads that value and nothing of params; what changes no byte (threads, endpoints, progress)
travels beside it. key = first 12 hex of SHA-256 over the canonical JSON of
    [stage, the stage's declared code version, values, upstream keys]
so an artifact's path changes exactly when something that made it changes; "stale" never
depends on mtimes. No code enters a key but through its version: `eaglet.graph.code` keeps the
versions honest against the kernels' digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from eaglet import __version__, locks
from eaglet.errors import EagletError
from eaglet.formats.io import dumps
from eaglet.graph import code
from eaglet.hashing import file_digest
from eaglet.model.target import (
    TargetSpec,
    read_config,
    spec_of,
    text_config,
)
from eaglet.params import Params

KEY_LEN = 12
V = TypeVar("V")


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # the stage's package: its `CODE` (version, kernel) in `__init__`
    ext: str  # file suffix, or "/" for a directory artifact
    kind: str  # what the name names: "dataset" or "drafter"
    variant: tuple[str, ...] = ()  # passed on to the spec's `spec_of` (export: the format)

    @property
    def spec_module(self) -> str:
        """`<module>.spec`: the spec dataclass and `spec_of`, importing no torch."""
        return f"{self.module}.spec"

    @property
    def run_module(self) -> str:
        """`<module>.run`: the stage's `setup` and `run`."""
        return f"{self.module}.run"


STAGES: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("prompts", "eaglet.stages.prompts", ".jsonl.zst", "dataset"),
        Stage("responses", "eaglet.stages.responses", ".jsonl.zst", "dataset"),
        Stage("hidden", "eaglet.stages.hidden", "/", "dataset"),
        Stage("vocab", "eaglet.stages.vocab", ".safetensors", "drafter"),
        Stage("train", "eaglet.stages.train", "/", "drafter"),
        Stage("evaluate", "eaglet.stages.evaluate", "/", "drafter"),
        Stage("sglang", "eaglet.stages.export", "/", "drafter", ("sglang",)),
        Stage("vllm", "eaglet.stages.export", "/", "drafter", ("vllm",)),
    ]
}


def stage_named(stage: str, exports: str = "sglang or vllm") -> Stage:
    """The stage called `stage`; an unknown name is one error listing the stages there are
    (for an export, which is named by its format: `exports`)."""
    if stage in STAGES:
        return STAGES[stage]
    known = ", ".join(STAGES)
    hint = f"; an export's stage is its format: {exports}" if "export" in stage.lower() else ""
    raise EagletError(f"no stage '{stage}' (stages: {known}){hint}")


def code_version(stage: str) -> int:
    """The stage's declared code version (its module's CODE, read without importing it)."""
    return code.declared(stage, stage_named(stage).module).version


def check_code(stage: str) -> None:
    """Stop `stage` when its kernel differs from the lock at the same version."""
    code.check(stage, stage_named(stage).module)


@dataclass(frozen=True)
class Spec(Generic[V]):
    """One artifact, resolved once: the typed value its stage's run reads instead of params."""

    stage: str
    name: str  # the dataset or drafter
    key: str
    code_version: int
    values: V  # the stage's frozen dataclass: what its output's bytes depend on
    upstream: dict  # the keys of the artifacts it reads

    def params(self) -> dict:
        """The values as the key hashes them: plain JSON, numbers canonical."""
        return canonical(asdict(self.values))

    def provenance(self) -> dict:
        """The sidecar's record of what made the artifact."""
        return {
            "stage": self.stage,
            STAGES[self.stage].kind: self.name,
            "key": self.key,
            "code_version": self.code_version,
            "params": self.params(),
            "upstream": self.upstream,
            "eaglet_version": __version__,
        }


class Keys:
    """Keys, paths and provenance of every artifact a params file defines (memoized)."""

    def __init__(self, params: Params):
        self.params = params
        self._memo: dict[tuple[str, str], Spec] = {}

    @cached_property
    def target(self) -> TargetSpec:
        """The configured target, resolved once (a hub ref pinned to its commit)."""
        return spec_of(self.params)

    def target_identity(self) -> dict:
        return self._identity

    @cached_property
    def _identity(self) -> dict:
        return self.target.identity()

    @cached_property
    def target_config(self) -> tuple[dict, str]:
        """(the target's config.json as written, where it was read): nothing else is read."""
        return read_config(self.target)

    def target_text_config(self) -> tuple[dict, str, str]:
        """(the target's text config as JSON, file, field prefix)."""
        raw, where = self.target_config
        text, prefix = text_config(raw)
        return text, where, prefix

    def spec(self, stage: str, name: str) -> Spec:
        """The artifact resolved: its stage's typed values, its upstream keys, its key. The
        values come from the stage's own `spec_of(keys, name)`, beside the code that reads them
        (`eaglet.stages.<stage>.spec`)."""
        if (stage, name) not in self._memo:
            st = stage_named(stage)
            spec_of = importlib.import_module(st.spec_module).spec_of
            values, upstream = spec_of(self, name, *st.variant)
            version = code_version(stage)
            payload = [stage, version, canonical(asdict(values)), upstream]
            key = hashlib.sha256(dumps(payload).encode()).hexdigest()[:KEY_LEN]
            self._memo[(stage, name)] = Spec(stage, name, key, version, values, upstream)
        return self._memo[(stage, name)]

    def dataset_keys(self, stage: str, drafter: str) -> dict:
        """{dataset: key} of `stage` over the drafter's datasets."""
        return {ds: self.key(stage, ds) for ds in self.params.drafter(drafter)["datasets"]}

    def provenance(self, stage: str, name: str) -> dict:
        """What made the artifact: the inputs of its key, and the key itself."""
        return self.spec(stage, name).provenance()

    def key(self, stage: str, name: str) -> str:
        return self.spec(stage, name).key

    def path(self, stage: str, name: str) -> Path:
        """data/<stage>/<dataset>/<key><ext> or models/<drafter>/<stage>/<key><ext>, under the
        params file's directory."""
        st = stage_named(stage)
        where = ("data", stage, name) if st.kind == "dataset" else ("models", name, stage)
        base = self.params.root.joinpath(*where, self.key(stage, name))
        return base if st.ext == "/" else base.with_name(base.name + st.ext)

    def sidecar(self, stage: str, name: str) -> Path:
        return sidecar_of(self.path(stage, name))


def canonical(value):
    """`value` with every integral float as an int (YAML's `8.0` is params' `8`), recursively;
    booleans stay booleans."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return value


def sidecar_of(artifact: Path) -> Path:
    """The JSON beside an artifact (`<key>.json`): its provenance and stats."""
    artifact = Path(artifact)
    return artifact.parent / f"{artifact.name.split('.')[0]}.json"


def file_key(p: Params, path: str, where: str) -> str:
    """SHA-256 of the file at `path` (relative to the params file), named by `where`: a file
    enters a key by its bytes, never by where it lies."""
    source = p.resolve(path)
    where = f"{p.path}: {where}.path: {source}"
    if source.exists() and not source.is_file():  # a folder, a FIFO: open() would fail or hang
        raise EagletError(f"{where}: not a regular file")
    try:
        return file_digest(source)
    except (FileNotFoundError, NotADirectoryError):
        raise EagletError(f"{where}: no such file") from None
    except OSError as e:
        raise EagletError(f"{where}: cannot read ({e.strerror})") from None


def stage_module(stage: str) -> ModuleType:
    """The stage's run module: its setup and its run."""
    return importlib.import_module(stage_named(stage).run_module)


def resolve_stage(stage: str, params: Params, name: str, **options: Any) -> tuple[Spec, Any]:
    """The artifact's spec and its stage's setup (what changes no byte: paths, threads,
    engines), each made once; `options` go to the setup."""
    keys = Keys(params)
    spec = keys.spec(stage, name)
    return spec, stage_module(stage).setup(keys, spec, **options)


# the command that builds (or continues) each stage's artifact of a name
COMMANDS = {
    "prompts": "eaglet prompts {}",
    "responses": "eaglet generate {}",
    "hidden": "eaglet hidden {}",
    "vocab": "eaglet vocab {}",
    "train": "eaglet train {}",
    "evaluate": "eaglet evaluate {}",
    "sglang": "eaglet export {} --to sglang",
    "vllm": "eaglet export {} --to vllm",
}


def lock_of(artifact: Path) -> Path:
    """The lock its build holds: `.<key><ext>.lock` beside the artifact (eaglet.locks)."""
    artifact = Path(artifact)
    return artifact.parent / f".{artifact.name}.lock"


def build(stage: str, params: Params, name: str, out: Path | None = None, **options: Any) -> Any:
    """Build one artifact of `stage` for dataset or drafter `name` at its keyed path (or `out`)
    and return what the stage's run returns (the path). One build of an artifact at a time: a
    second is refused, naming the first (under torchrun, rank 0 holds it for all)."""
    check_code(stage)  # an edited kernel whose version stayed stops here
    spec, setup = resolve_stage(stage, params, name, **options)
    path = Path(out) if out else Keys(params).path(stage, name)
    command = COMMANDS[stage].format(name)
    held = contextlib.ExitStack()
    if os.environ.get("RANK", "0") == "0":
        try:
            held.enter_context(locks.hold(lock_of(path), command))
        except locks.Locked as e:
            verb = command.split()[1]
            raise EagletError(
                f"{stage} {name}: another eaglet {verb} is running ({e}); wait for it or stop it"
            ) from None
    with held:
        return stage_module(stage).run(spec, setup, path)
