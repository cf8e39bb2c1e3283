"""Content keys and keyed paths: the one place that says where each artifact lives.

A stage's artifact is resolved once, here, into a `Spec`: the stage's values (its slice of
params with everything resolved: device, dtype, a hub target's commit, layer ids, the drafter's
arch; never `auto` or a moving ref) and the keys of its upstream artifacts. The stage's `run`
reads that value and nothing of params; what changes no byte (threads, endpoints, progress)
travels beside it. key = first 12 hex of SHA-256 over the canonical JSON of
    [stage, code key of the stage's module, values, upstream keys]
so an artifact's path changes exactly when something that made it changes; "stale" never
depends on mtimes.

The code key covers the code that computes the artifact's bytes and nothing else: the AST
(docstrings and eaglet's own import statements stripped) of the stage's module and of every
eaglet module it imports, transitively, except PLUMBING, where the walk stops. Comments,
formatting and where a module lies in the package change nothing.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

from eaglet import __version__
from eaglet.device import device_type, resolve_dtype
from eaglet.errors import EagletError
from eaglet.formats.hashing import JsonCache, file_digest
from eaglet.formats.io import dumps
from eaglet.graph.footprint import in_process, in_process_bytes
from eaglet.model import arch
from eaglet.model.target import (
    TargetSpec,
    need,
    read_config,
    reference,
    spec_of,
    text_config,
)
from eaglet.params import Params

KEY_LEN = 12
# How code keys were formed; compare names a change, which moves every key once.
LAYOUTS = {
    1: "one flat package",
    2: "modules moved to stages/, model/, formats/, ...",
    3: "code keys without module names (a later move changes none)",
    4: "AST digests without empty fields: the same on CPython 3.11 to 3.13",
}
LAYOUT = 4
NOT_IN_TRAIN_KEY = ("checkpoint_every", "device", "min_supervised_share")  # no output byte


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # the module whose code (and imports) make the artifact
    ext: str  # file suffix, or "/" for a directory artifact
    kind: str  # what the name names: "dataset" or "drafter"
    loaded: tuple[str, ...] = ()  # compute an engine loads by name (eaglet never imports it)

    @property
    def roots(self) -> tuple[str, ...]:
        return (self.module, *self.loaded)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("prompts", "eaglet.stages.prompts", ".jsonl.zst", "dataset"),
        Stage("responses", "eaglet.stages.generate", ".jsonl.zst", "dataset"),
        Stage(
            "hidden", "eaglet.stages.hidden", "/", "dataset", ("eaglet.engines.hidden_connector",)
        ),
        Stage("vocab", "eaglet.stages.vocab", ".safetensors", "drafter"),
        Stage("train", "eaglet.stages.train", "/", "drafter"),
        Stage(
            "evaluate", "eaglet.stages.evaluate", "/", "drafter", ("eaglet.engines.vllm_plugin",)
        ),
        Stage("sglang", "eaglet.stages.export", "/", "drafter"),
        Stage("vllm", "eaglet.stages.export", "/", "drafter"),
    ]
}


# Code that never shapes an output byte: the key machinery and params loading (their results
# enter keys as values), the CLI, progress, status and reports (`plan`, the dry-run report),
# checks of built artifacts, the response cache, atomic writes, the package version. Editing
# these moves no key.
PLUMBING = frozenset(
    {
        "eaglet",  # the package: __version__
        "eaglet.__main__",
        "eaglet.engines",  # the packages (their docstrings), to eaglet.stages
        "eaglet.formats",
        "eaglet.graph",
        "eaglet.model",
        "eaglet.reports",
        "eaglet.stages",
        "eaglet.cli",
        "eaglet.device",
        "eaglet.engines.reaper",  # ends an engine whose owner died
        "eaglet.errors",
        "eaglet.formats.atomic",
        "eaglet.formats.hashing",
        "eaglet.formats.store",
        "eaglet.graph.artifacts",
        "eaglet.graph.footprint",  # resolves evaluate.in_process: the resolved value is in the key
        "eaglet.graph.keys",
        "eaglet.params",
        "eaglet.progress",
        "eaglet.reports.compare",
        "eaglet.reports.placement",  # `eaglet plan` only
        "eaglet.reports.plan",
        "eaglet.reports.publish",
        "eaglet.reports.report",
        "eaglet.reports.status",
        "eaglet.stages.foreign",
        "eaglet.stages.hidden_setup",  # a Protocol for type hints: no code runs
        "eaglet.stages.hidden_verify",
        "eaglet.stages.preflight",
        "eaglet.stages.supervised",  # a check before training: stops or passes, writes nothing
    }
)


@cache
def code_key(*roots: str) -> str:
    """Hash of the normalized ASTs of `roots` and the eaglet modules they import (transitively):
    the sorted digests, without module names, so moving or renaming a module changes nothing."""
    h = hashlib.sha256()
    for digest in sorted(_facts(name)[0] for name in set().union(*map(_closure, roots))):
        h.update(f"{digest}\n".encode())
    _AST_CACHE.save()
    return h.hexdigest()[:KEY_LEN]


PACKAGE = Path(__file__).resolve().parents[1]  # src/eaglet
# (AST digest, imported names) of each module under the SHA-256 of its name and bytes: a pure
# function of the source, so a hit is always right; a parse costs ~10 ms a module otherwise, at
# every Snakefile parse. Per Python version all the same: a newer parser's tree is another object.
_AST_CACHE = JsonCache(f"code-ast-v4-py{sys.version_info[0]}{sys.version_info[1]}.json")


def _file(module: str) -> Path | None:
    """The source file of an eaglet module, found on disk: find_spec would import the parent
    packages of a dotted name (and so torch, at Snakefile parse time)."""
    parts = module.split(".")
    if parts[0] != "eaglet":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _source(module: str) -> Path:
    path = _file(module)
    if path is None:
        raise EagletError(f"code key: module {module} not found")
    return path


@cache
def _facts(module: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The module's AST digest (docstrings and eaglet imports stripped) and its eaglet imports as
    (name, fallback) pairs: `from eaglet.x import y` is module eaglet.x.y if that file exists,
    else names in eaglet.x. The imports enter the key as the modules they bring in."""
    source = _source(module).read_bytes()
    stamp = hashlib.sha256(module.encode() + b"\0" + source).hexdigest()
    hit = _AST_CACHE.entries.get(stamp)
    if hit is not None:
        return hit[0], tuple((a, b) for a, b in hit[1])
    tree = ast.parse(source)
    imports = tuple(sorted(_import_names(module, tree)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:] if isinstance(body[0].value.value, str) else body
            node.body = _names_not_places(module, body) or [ast.Pass()]
    digest = hashlib.sha256(stable_dump(tree).encode()).hexdigest()
    _AST_CACHE.put(stamp, [digest, [list(pair) for pair in imports]])
    return digest, imports


def stable_dump(node: object) -> str:
    """The tree as text, the same for the same source on CPython 3.11 to 3.13: `ast.dump`'s is
    not (3.12 adds `type_params=[]` to every function and class, 3.13 drops empty fields), so
    fields that are None or empty are left out on every version."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={stable_dump(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(map(stable_dump, node)) + "]"
    return repr(node)


def _names_not_places(module: str, body: list[ast.stmt]) -> list[ast.stmt]:
    """`body` with its eaglet import statements as one statement of the names they bind, sorted:
    which module a name comes from enters the key as that module's code, not as its place."""
    names, rest = [], []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom) and _eaglet_only(module, node):
            attr = isinstance(node, ast.ImportFrom)  # `import eaglet.x as m` binds a module
            names += [(a.name if attr else "", a.asname or "") for a in node.names]
        else:
            rest.append(node)
    if not names:
        return rest
    aliases = [ast.alias(name, asname or None) for name, asname in sorted(names)]
    return [ast.ImportFrom(None, aliases, 0), *rest]


def _eaglet_only(module: str, node: ast.Import | ast.ImportFrom) -> bool:
    return len(_import_names(module, ast.Module([node], []))) == len(node.names)


def _import_names(module: str, tree: ast.Module) -> set[tuple[str, str]]:
    """eaglet imports anywhere in `module` (top level or inside functions), unresolved."""
    found = set()
    package = module if _source(module).name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((a.name, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.update((f"{base}.{alias.name}", base) for alias in node.names)
    return {(a, b) for a, b in found if b == "eaglet" or b.startswith("eaglet.")}


def _imports(module: str) -> set[str]:
    """eaglet modules `module` imports; never a third-party package imported to hash our code."""
    return {name if _file(name) else fallback for name, fallback in _facts(module)[1]}


def _closure(module: str) -> set[str]:
    """`module` and the eaglet modules it imports, transitively, never entering PLUMBING."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen and m not in PLUMBING:
            seen.add(m)
            todo.extend(_imports(m) - seen)
    return seen


@dataclass(frozen=True)
class Spec:
    """One artifact, resolved once: a plain value its stage's run reads instead of params."""

    stage: str
    name: str  # the dataset or drafter
    key: str
    code_key: str
    values: dict  # the stage's resolved settings: what its output's bytes depend on
    upstream: dict  # the keys of the artifacts it reads

    def provenance(self) -> dict:
        """The sidecar's record of what made the artifact."""
        return {
            "stage": self.stage,
            STAGES[self.stage].kind: self.name,
            "key": self.key,
            "code_key": self.code_key,
            "code_layout": LAYOUT,
            "params": self.values,
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
        """The artifact resolved: the values its stage's run reads, its upstream keys, its key."""
        if (stage, name) not in self._memo:
            st = STAGES[stage]
            values, upstream = _SLICES[stage](self, name)
            values = canonical(values)  # `8.0` and `8` are one value, one key
            code = code_key(*st.roots)
            payload = [stage, code, values, upstream]
            key = hashlib.sha256(dumps(payload).encode()).hexdigest()[:KEY_LEN]
            self._memo[(stage, name)] = Spec(stage, name, key, code, values, upstream)
        return self._memo[(stage, name)]

    def provenance(self, stage: str, name: str) -> dict:
        """What made the artifact: the inputs of its key, and the key itself."""
        return self.spec(stage, name).provenance()

    def key(self, stage: str, name: str) -> str:
        return self.spec(stage, name).key

    def path(self, stage: str, name: str) -> Path:
        """data/<stage>/<dataset>/<key><ext> or models/<drafter>/<stage>/<key><ext>, under the
        params file's directory."""
        st = STAGES[stage]
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


def _digest(p: Params, path: str, where: str) -> str:
    """SHA-256 of the file at `path` (relative to the params file), named by `where`."""
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


def _suite_digest(p: Params, suite: dict, where: str) -> str:
    """SHA-256 of an evaluation suite's file (HumanEval's: the installed package's)."""
    from eaglet.formats.datasets import humaneval_path

    if "path" in suite:
        return _digest(p, suite["path"], where)
    return file_digest(humaneval_path())


def _prompts_slice(keys: Keys, ds: str) -> tuple[dict, dict]:
    p = keys.params
    d = p.dataset(ds)
    digest = _digest(p, d["path"], f"datasets.{ds}")
    max_prompt_tokens = d.get("max_prompt_tokens", p.data["prompts"].get("max_prompt_tokens"))
    slice_ = {
        "source_sha256": digest,
        "format": d["format"],
        "max_samples": d.get("max_samples"),
        "seed": d.get("prompt_seed", p.data["prompts"]["seed"]),
        "max_prompt_tokens": max_prompt_tokens,
        "grammar": p.target["grammar"],  # spells the tool-call ids
    }
    if max_prompt_tokens:
        slice_["target"] = keys.target_identity()
    return slice_, {}


def _responses_slice(keys: Keys, ds: str) -> tuple[dict, dict]:
    p = keys.params
    sampling = p.generation(ds)
    sampling.pop("max_token_drift")  # a check: stops or passes, changes no byte
    backend = p.backend_identity(sampling.pop("backend"))
    d = p.dataset(ds)
    slice_ = {
        "backend": backend,
        "sampling": sampling,
        "token_budget": d.get("token_budget"),
        "max_cost_usd": d.get("max_cost_usd"),
        "grammar": p.target["grammar"],  # writes the text answers as the target's tokens
        "max_length": p.max_length(ds),  # longer prompts are left out
    }
    slice_["target"] = keys.target_identity()  # generates, or tokenizes the answers of an API
    return slice_, {"prompts": keys.key("prompts", ds)}


def _hidden_slice(keys: Keys, ds: str) -> tuple[dict, dict]:
    h = keys.params.data["hidden"]
    compute = {"backend": h["backend"]}
    if h["backend"] in ("transformers", "vllm"):  # an operator's vllm: set compute_dtype to its
        compute["device"] = device_type(h["device"])
        compute["dtype"] = resolve_dtype(h["compute_dtype"], h["device"])
    slice_ = {
        "target": keys.target_identity(),
        "max_length": keys.params.max_length(ds),
        "aux_layer_ids": layer_ids(keys, h),
        "compute": compute,
        "dtype": h["dtype"],
        "storage": {"compress": h["compress"], "fp8": h["fp8"], "shard_mb": h["shard_mb"]},
    }
    if h["mode"] != "offline":  # a manifest-only directory: other bytes (not in train's slice)
        slice_["mode"] = h["mode"]
    return slice_, {"responses": keys.key("responses", ds)}


def default_layer_ids(n_layers: int) -> list[int]:
    """SGLang's default EAGLE-3 aux layers: outputs of layers 1, N//2-1 and N-4 (0-based)."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def layer_ids(keys: Keys, hidden: dict) -> list[int]:
    """The aux layers in SGLang's convention, checked against the target's layer count."""
    text, where, prefix = keys.target_text_config()
    n_layers = need(text, "num_hidden_layers", where, prefix)
    ids = sglang_layer_ids(hidden) or default_layer_ids(n_layers)
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        shift = 1 if hidden["aux_layer_convention"] == "vllm" else 0
        raise EagletError(
            f"{keys.params.path}: hidden.aux_layer_ids: {[i + shift for i in bad]} out of range "
            f"for a target of {n_layers} layers ({where}: {prefix}num_hidden_layers; "
            f"{hidden['aux_layer_convention']} ids: {shift} .. {n_layers - 1 + shift})"
        )
    return list(ids)


def sglang_layer_ids(hidden: dict) -> list[int] | None:
    """`hidden.aux_layer_ids` in SGLang's convention (vLLM ids are SGLang's + 1), or None."""
    ids = hidden.get("aux_layer_ids")
    if ids is None:
        return None
    return [i - 1 for i in ids] if hidden["aux_layer_convention"] == "vllm" else list(ids)


def _hidden_keys(keys: Keys, drafter: str) -> dict:
    return {ds: keys.key("hidden", ds) for ds in keys.params.drafter(drafter)["datasets"]}


def _vocab_slice(keys: Keys, drafter: str) -> tuple[dict, dict]:
    d = keys.params.drafter(drafter)
    return {"draft_vocab_size": d["draft_vocab_size"]}, {"hidden": _hidden_keys(keys, drafter)}


def _train_slice(keys: Keys, drafter: str) -> tuple[dict, dict]:
    p, d = keys.params, keys.params.drafter(drafter)
    train = {k: v for k, v in d["train"].items() if k not in NOT_IN_TRAIN_KEY}
    train["max_length"] = train.get("max_length") or max(map(p.max_length, d["datasets"]))
    train["device"] = device_type(d["train"]["device"])
    train["dtype"] = resolve_dtype(d["train"]["dtype"], d["train"]["device"])
    text, where, prefix = keys.target_text_config()
    resolved = arch.resolve(text, d["arch"], where, prefix)
    slice_ = {
        "train": train,
        "heldout_fraction": d["heldout_fraction"],
        "target": keys.target_identity(),  # the frozen embeddings and lm_head come from it
        "arch": resolved,  # resolved: every field, never "from the target"
        "arch_differs_from_target": arch.differs(text, resolved),
    }
    upstream = {"vocab": keys.key("vocab", drafter), "hidden": _hidden_keys(keys, drafter)}
    return slice_, upstream


def _evaluate_slice(keys: Keys, drafter: str) -> tuple[dict, dict]:
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
    if evaluate.pop("engine_url", None):  # where it listens is plumbing, whose engine is not
        evaluate["engine_operator"] = True
    if "suites" in evaluate:  # each file's bytes, not where it lies
        evaluate["suites"] = {
            name: {
                "sha256": _suite_digest(
                    keys.params, s, f"drafters.{drafter}.evaluate.suites.{name}"
                ),
                "format": s["format"],
                "prompts": s.get("prompts", evaluate["prompts"]),
            }
            for name, s in evaluate["suites"].items()
        }
    slice_ = {
        "evaluate": evaluate,
        "heldout_fraction": d["heldout_fraction"],
        "target": keys.target_identity(),
    }
    upstream = {"train": keys.key("train", drafter), "hidden": _hidden_keys(keys, drafter)}
    if evaluate["engine"] != "none":  # the engine serves the drafter's vLLM export
        upstream["vllm"] = keys.key("vllm", drafter)
    return slice_, upstream


def _export_slice(fmt: str) -> Callable[[Keys, str], tuple[dict, dict]]:
    def slice_(keys: Keys, drafter: str) -> tuple[dict, dict]:
        p = keys.params
        steps = min(p.drafter(drafter)["evaluate"]["num_steps"])
        slice_ = {
            "format": fmt,
            "num_steps": steps,
            "verifier": reference(keys.target, p.target.get("hub_id"), p.root),
            "verifier_architectures": keys.target_config[0].get("architectures"),
            "arch_differs_from_target": keys.spec("train", drafter).values[
                "arch_differs_from_target"
            ],
        }
        return slice_, {"train": keys.key("train", drafter)}

    return slice_


_SLICES: dict[str, Callable[[Keys, str], tuple[dict, dict]]] = {
    "prompts": _prompts_slice,
    "responses": _responses_slice,
    "hidden": _hidden_slice,
    "vocab": _vocab_slice,
    "train": _train_slice,
    "evaluate": _evaluate_slice,
    "sglang": _export_slice("sglang"),
    "vllm": _export_slice("vllm"),
}
