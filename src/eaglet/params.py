"""params.yaml: load, validate against the schema, fill defaults, resolve per-dataset settings.

Every error is one line that names the file, the key path and what was expected.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from eaglet.device import device_type, resolve_dtype
from eaglet.errors import EagletError

SCHEMA_PATH = Path(__file__).with_name("params.schema.yaml")
GENERATION_KEYS = (
    "backend",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "thinking",
    "thinking_fraction",
    "truncated",
    "marker_text",
    "turns",
)
# The settings of a backend that change what it returns (not how fast): they enter the keys.
BACKEND_IDENTITY_KEYS = {
    "transformers": ("kind", "dtype"),
    "sglang": ("kind", "endpoint"),
    "openai": (
        "kind",
        "base_url",
        "model",
        "provider",
        "reasoning",
        "reasoning_field",
        "extra_body",
    ),
    "vllm": ("kind", "dtype", "enforce_eager", "tensor_parallel_size"),
}


# libyaml's parser where PyYAML has it: 6x faster, and every Snakefile parse loads both files.
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a key written twice in one mapping (PyYAML keeps the last
    silently, so the first setting would be lost without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:  # `<<: *base` keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:  # unhashable: the base constructor says so
                    continue
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key '{key}' (first on line {seen.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


@cache
def schema() -> dict:
    return read_yaml(SCHEMA_PATH.read_text())


@dataclass(frozen=True)
class Params:
    """A validated params file with defaults filled in; paths resolve against its directory."""

    path: Path
    data: dict

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def target(self) -> dict:
        return self.data["target"]

    @property
    def datasets(self) -> list[str]:
        return list(self.data["datasets"])

    @property
    def drafters(self) -> list[str]:
        return list(self.data["drafters"])

    def dataset(self, name: str) -> dict:
        try:
            return self.data["datasets"][name]
        except KeyError:
            known = ", ".join(self.datasets)
            raise EagletError(f"{self.path}: no dataset '{name}' (known: {known})") from None

    def drafter(self, name: str) -> dict:
        try:
            return self.data["drafters"][name]
        except KeyError:
            known = ", ".join(self.drafters) or "none"
            raise EagletError(f"{self.path}: no drafter '{name}' (known: {known})") from None

    def resolve(self, relpath: str | os.PathLike) -> Path:
        """A path from params, made absolute against the params file's directory."""
        p = Path(os.path.expanduser(relpath))
        return p if p.is_absolute() else self.root / p

    def generation(self, dataset: str) -> dict:
        """The dataset's generation settings: `generation:` overridden by the dataset's own."""
        ds = self.dataset(dataset)
        out = dict(self.data["generation"])
        out.update({k: ds[k] for k in GENERATION_KEYS if k in ds})
        return out

    def max_length(self, dataset: str) -> int:
        """Tokens per hidden-states sequence of the dataset (its own, else target.max_length)."""
        return self.dataset(dataset).get("max_length", self.target["max_length"])

    def backend(self, name: str) -> dict:
        try:
            return self.data["backends"][name]
        except KeyError:
            known = ", ".join(self.data["backends"])
            raise EagletError(f"{self.path}: no backend '{name}' (known: {known})") from None

    def backend_identity(self, name: str) -> dict:
        """What about a backend changes its answers, `auto` resolved: enters the response keys."""
        cfg = self.backend(name)
        out = {k: cfg[k] for k in BACKEND_IDENTITY_KEYS[cfg["kind"]] if k in cfg}
        if cfg["kind"] in ("transformers", "vllm"):
            out["device"] = device_type(cfg.get("device", "auto"))
            out["dtype"] = resolve_dtype(cfg["dtype"], cfg.get("device", "auto"))
        return out


def load(path: str | os.PathLike = "params.yaml") -> Params:
    """Read, validate and complete a params file; raise EagletError with a one-line reason.

    A file with `extends: <params file>` (relative to itself) is an overlay: the base is read
    (itself maybe an overlay), this file is merged onto it as a JSON Merge Patch (RFC 7396:
    mappings merge key by key, `null` removes a key, any other value replaces), and the result
    is validated and keyed as one params file whose paths resolve against the overlay's folder.
    """
    path = Path(path).resolve()
    return from_dict(_merged(path, ()), path)


def _read(path: Path) -> dict:
    try:
        raw = read_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EagletError(f"{path}: no such params file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise EagletError(f"{path}:{where} invalid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise EagletError(f"{path}: expected a mapping at the top level")
    return raw


def merged(path: Path) -> dict:
    """The params file at `path` with its `extends:` chain applied, not validated."""
    return _merged(Path(path).resolve(), ())


def _merged(path: Path, chain: tuple[Path, ...]) -> dict:
    """The params file at `path` with its `extends:` chain applied."""
    if path in chain:
        raise EagletError(f"{path}: extends: a cycle ({' -> '.join(map(str, (*chain, path)))})")
    raw = _read(path)
    base = raw.pop("extends", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise EagletError(f"{path}: extends: expected the path of a params file")
    parent = Path(os.path.expanduser(base))
    parent = (parent if parent.is_absolute() else path.parent / parent).resolve()
    return merge_patch(_merged(parent, (*chain, path)), raw)


def run_here(params: Params, folder: str | os.PathLike) -> Params:
    """`params`, if Snakemake runs in its folder: eaglet resolves a params file's paths (raw
    files, data/, models/) against the file's folder, Snakemake its rule outputs against the
    folder it runs in, and they agree only when the two are one."""
    if params.root.resolve() != Path(folder).resolve():
        raise EagletError(
            f"{params.path}: a params file outside the folder Snakemake runs in ({folder}): its "
            f"paths resolve against {params.root}, the rules' outputs against the working "
            "directory; put it (and any overlay) at the project's root, or run there"
        )
    return params


def merge_patch(base: Any, patch: Any) -> Any:
    """RFC 7396: `patch` applied to `base` (neither is modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def from_dict(raw: dict, path: Path) -> Params:
    data = copy.deepcopy(raw)
    _validate(data, path)
    _fill_defaults(schema(), data, schema())
    _check_references(data, path)
    return Params(path=path, data=data)


def _validate(data: dict, path: Path) -> None:
    validator = jsonschema.Draft202012Validator(schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is None:
        return
    # Descend into if/then and allOf to report the innermost, most specific failure.
    while error.context:
        error = jsonschema.exceptions.best_match(error.context)
    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    raise EagletError(f"{path}: {where}: {error.message}")


def _check_references(data: dict, path: Path) -> None:
    backends = data["backends"]
    for scope, cfg in [("generation", data["generation"])] + [
        (f"datasets.{n}", d) for n, d in data["datasets"].items()
    ]:
        if "backend" in cfg and cfg["backend"] not in backends:
            known = ", ".join(backends)
            raise EagletError(
                f"{path}: {scope}.backend: unknown backend '{cfg['backend']}' (known: {known})"
            )
    for name, drafter in data["drafters"].items():
        weighted = isinstance(drafter["datasets"], dict)
        for i, ds in enumerate(drafter["datasets"]):
            if ds not in data["datasets"]:
                at = ds if weighted else i
                raise EagletError(f"{path}: drafters.{name}.datasets.{at}: unknown dataset '{ds}'")
        check_weights(drafter["datasets"], f"{path}: drafters.{name}.datasets")
        for k, phase in enumerate(drafter["train"].get("phases", [])):
            where = f"{path}: drafters.{name}.train.phases.{k}.datasets"
            for ds in phase.get("datasets", []):
                if ds not in drafter["datasets"]:
                    raise EagletError(
                        f"{where}.{ds}: the drafter does not read dataset '{ds}' "
                        f"(drafters.{name}.datasets: {', '.join(drafter['datasets'])})"
                    )
            check_weights(phase.get("datasets", []), where)
        ev = drafter["evaluate"]
        if "engine_url" in ev and (ev["engine"] != "vllm" or len(ev["num_steps"]) != 1):
            raise EagletError(
                f"{path}: drafters.{name}.evaluate.engine_url: needs engine: vllm and one "
                f"num_steps (the running engine's num_speculative_tokens), not {ev['num_steps']}"
            )
    _check_datasets(data, path)


def _check_datasets(data: dict, path: Path) -> None:
    """What the schema cannot say of a training dataset: its format is one it can train on, its
    dollar budget one its backend can keep (only `openai` reports a cost: usage.cost, or its
    tokens at `price_per_mtok`), and its file, where it exists, a file (so is a suite's)."""
    backends, default = data["backends"], data["generation"]["backend"]
    priced = []
    for name, d in data["datasets"].items():
        where = f"{path}: datasets.{name}"
        if d["format"] == "humaneval":
            raise EagletError(
                f"{where}.format: humaneval is an evaluation suite only "
                "(drafters.<name>.evaluate.suites), not a training dataset"
            )
        backend = d.get("backend", default)
        kind = backends[backend]["kind"]
        thinking = d.get("thinking", data["generation"]["thinking"])
        if thinking is not None and not data["target"]["thinking_switch"]:
            raise EagletError(
                f"{where}.thinking: {thinking} needs target.thinking_switch, the chat template's "
                "argument that turns thinking on and off (Kimi-K2.5: thinking; Qwen3: "
                "enable_thinking)"
            )
        if kind == "openai":
            priced.append(name)
        elif "max_cost_usd" in d:
            raise EagletError(
                f"{where}.max_cost_usd: backend '{backend}' ({kind}) reports no cost, so a dollar "
                "budget cannot stop it (only openai backends do; use token_budget)"
            )
        _check_file(where, d["path"], path)
    if "max_cost_usd" in data["budget"] and not priced:
        used = ", ".join(
            f"{n}: '{b}' ({backends[b]['kind']})"
            for n, b in ((n, d.get("backend", default)) for n, d in data["datasets"].items())
        )
        raise EagletError(
            f"{path}: budget.max_cost_usd: no dataset's backend reports a cost ({used}), so a "
            "dollar budget cannot stop any (only openai backends do; use budget.token_budget)"
        )
    for name, drafter in data["drafters"].items():
        if drafter["evaluate"].get("modes") and not data["target"]["thinking_switch"]:
            raise EagletError(
                f"{path}: drafters.{name}.evaluate.modes: needs target.thinking_switch, the chat "
                "template's argument that turns thinking on and off"
            )
        for suite, cfg in drafter["evaluate"].get("suites", {}).items():
            if "path" in cfg:
                _check_file(f"{path}: drafters.{name}.evaluate.suites.{suite}", cfg["path"], path)


def _check_file(where: str, relpath: str, path: Path) -> None:
    """A prompt file named in params must not be a directory (a missing one is only an error
    when a stage reads it: it may be fetched later)."""
    source = Path(os.path.expanduser(relpath))
    if os.path.isdir(source if source.is_absolute() else path.parent / source):
        raise EagletError(f"{where}.path: {relpath} is a directory, not a file of prompts")


def _resolve_ref(node: dict, root: dict) -> dict:
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        node = root
        for part in ref[2:].split("/"):
            node = node[part]
    return node


def _fill_defaults(node: dict, value: Any, root: dict) -> None:
    """Fill `default`s of the schema into an already-valid document, recursively."""
    node = _resolve_ref(node, root)
    if not isinstance(value, dict):
        return
    for sub in node.get("allOf", []):
        if "if" in sub and jsonschema.Draft202012Validator(sub["if"]).is_valid(value):
            _fill_defaults(sub.get("then", {}), value, root)
    props = node.get("properties", {})
    for key, sub in props.items():
        if not isinstance(sub, dict):
            continue
        if key not in value and "default" in sub:  # a default beside a $ref wins
            value[key] = copy.deepcopy(sub["default"])
        sub = _resolve_ref(sub, root)
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            _fill_defaults(sub, value[key], root)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        for key, item in value.items():
            if key not in props:
                _fill_defaults(extra, item, root)


def check_weights(datasets: list | dict, where: str) -> None:
    """One-line errors for a drafter's dataset weights that no mixture can follow (`where`
    names the field; eaglet.stages.train.mixture follows them)."""
    if not isinstance(datasets, dict):
        return
    for name, w in datasets.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or w < 0 or w != w:
            raise EagletError(f"{where}.{name}: weight {w!r}: a weight is a number of 0 or more")
        if w == float("inf"):
            raise EagletError(f"{where}.{name}: weight {w!r}: a weight is finite")
    if not any(datasets.values()):
        raise EagletError(
            f"{where}: every weight is 0: at least one dataset needs a weight above 0"
        )
