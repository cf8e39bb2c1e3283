"""Declared code versions: what of the code enters a key, and the guard that keeps it honest.

Each stage module declares `CODE = Code(version=N, kernel=(...))`: its kernel is the code that
shapes the bytes it writes (pure functions over records and arrays), named as `module` (all of
it) or `module:qualname`. A key hashes the stage's version, never its code, so plumbing (engines,
HTTP, process supervision, loading, progress, wording, where a function lies) moves no key.

`code.lock` (beside this package's modules) keeps a digest of each stage's kernel with the
version it was recorded at. A kernel that differs from the lock while the version stays fails
`make test`, and stops the stage in an edited clone, naming the stage and what changed. Then
either the output's bytes change (bump the version: the stage's key and every key downstream
move) or they do not (a refactor: record the new digest as the same bytes). Both end with
`eaglet code --lock`.

A kernel part's digest is its syntax tree, with the module-level constants it reads, without
docstrings, without the messages of its `raise` statements and without `print` calls, and
without imports: the same on CPython 3.11 to 3.13
(`stable_dump`), and the same wherever its parts lie, since the stage's digest hashes the sorted
digests of its parts, not their names.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.io import read_json, write_json

PACKAGE = Path(__file__).resolve().parents[1]  # src/eaglet
LOCK = PACKAGE / "code.lock"
DIGEST_LEN = 16


@dataclass(frozen=True)
class Code:
    """A stage's declared code: its version and the parts of its kernel."""

    version: int
    kernel: tuple[str, ...]


@dataclass(frozen=True)
class Declared:
    """A stage's CODE as its module declares it, read from the source (no import)."""

    stage: str
    module: str
    version: int
    kernel: tuple[str, ...]

    @property
    def file(self) -> str:
        return str(_file(self.module).relative_to(PACKAGE.parent))


def declared(stage: str, module: str) -> Declared:
    """The `CODE = Code(version=..., kernel=(...))` of `module`, read as literals, so that a key
    needs no import of the stage (and of torch)."""
    return _declared(stage, module, _file(module).read_bytes())


@cache
def _declared(stage: str, module: str, source: bytes) -> Declared:
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["CODE"]
            and isinstance(node.value, ast.Call)
        ):
            try:
                kw = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
                return Declared(stage, module, int(kw["version"]), tuple(kw["kernel"]))
            except (KeyError, ValueError, TypeError):
                break
    raise EagletError(
        f"{_file(module)}: stage {stage}: no CODE = Code(version=<int>, kernel=(<literal names>))"
    )


def _file(module: str) -> Path:
    base = PACKAGE.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise EagletError(f"code: module {module} not found under {PACKAGE}")


def part_digests(kernel: tuple[str, ...]) -> dict[str, str]:
    """The digest of each named part of a kernel."""
    return {part: _part_digest(part) for part in kernel}


def kernel_digest(parts: dict[str, str]) -> str:
    """One digest of a kernel: its parts' digests, sorted, without their names or places."""
    text = "\n".join(sorted(parts.values()))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LEN]


def _part_digest(part: str) -> str:
    module, _, qualname = part.partition(":")
    path = _file(module)
    return _digest_of(path.read_bytes(), qualname, str(path))


@cache
def _digest_of(source: bytes, qualname: str, where: str) -> str:
    tree = ast.parse(source)
    node: ast.AST = tree
    for name in filter(None, qualname.split(".")):
        found = [
            n
            for n in getattr(node, "body", [])
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and n.name == name
        ]
        if not found:
            raise EagletError(f"{where}: kernel part {qualname}: no such function or class")
        node = found[0]
    parts = [node] if node is tree else [node, *_constants(tree, node)]
    text = "\n".join(stable_dump(_Wording().visit(p)) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LEN]


def _constants(tree: ast.Module, node: ast.AST) -> list[ast.stmt]:
    """The module-level assignments a function or class reads (`LOGITS = 2**23`), and those
    they read in turn: part of the kernel as much as the code that uses them."""
    assigned = {}
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for t in targets:
            if isinstance(stmt, ast.Assign | ast.AnnAssign) and isinstance(t, ast.Name):
                assigned[t.id] = stmt
    seen: dict[str, ast.stmt] = {}
    todo = [node]
    while todo:
        for n in ast.walk(todo.pop()):
            if isinstance(n, ast.Name) and n.id in assigned and n.id not in seen:
                seen[n.id] = assigned[n.id]
                todo.append(assigned[n.id])
    return [seen[name] for name in sorted(seen)]


class _Wording(ast.NodeTransformer):
    """What never shapes an output byte: docstrings, imports, messages of errors, prints."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (_docstring(s) or _import(s) or _print(s))]
            node.body = kept or [ast.Pass()]
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.Raise:
        if isinstance(node.exc, ast.Call):  # raise E("...") -> raise E
            node.exc = node.exc.func
        node.cause = None
        return node


def _docstring(s: ast.stmt) -> bool:
    return (
        isinstance(s, ast.Expr)
        and isinstance(s.value, ast.Constant)
        and isinstance(s.value.value, str)
    )


def _import(s: ast.stmt) -> bool:
    return isinstance(s, ast.Import | ast.ImportFrom)


def _print(s: ast.stmt) -> bool:
    return (
        isinstance(s, ast.Expr)
        and isinstance(s.value, ast.Call)
        and getattr(s.value.func, "id", None) == "print"
    )


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


# ---- the lock and the guard


@dataclass(frozen=True)
class State:
    """A stage's declared code against the lock."""

    code: Declared
    digest: str  # the kernel's digest now
    parts: dict[str, str]
    locked: dict | None  # the lock's entry: version, digest, parts

    @property
    def ok(self) -> bool:
        return self.locked is not None and (self.code.version, self.digest) == (
            self.locked["version"],
            self.locked["digest"],
        )

    @property
    def bumped(self) -> bool:
        return self.locked is not None and self.code.version != self.locked["version"]

    def changed_parts(self) -> list[str]:
        old = (self.locked or {}).get("parts", {})
        moved = set(self.parts.values()) - set(old.values())
        return [p for p, d in self.parts.items() if d in moved] or list(self.parts)

    def problem(self) -> str | None:
        """One line saying what is wrong, or None."""
        c = self.code
        if self.ok:
            return None
        if self.locked is None:
            return f"stage {c.stage}: not in {LOCK.name}: run `eaglet code --lock`"
        if self.bumped:
            return (
                f"stage {c.stage}: version {c.version} in {c.file} is not in {LOCK.name} "
                f"(version {self.locked['version']}): run `eaglet code --lock`"
            )
        return (
            f"stage {c.stage}: its kernel changed ({', '.join(self.changed_parts())}) but not its "
            f"version: bump CODE's version in {c.file} if its output's bytes change, else record "
            f"the same bytes: eaglet code --lock --same-bytes {c.stage}"
        )


def read_lock() -> dict:
    if not LOCK.exists():
        return {}
    return read_json(LOCK).get("stages", {})


def states(stages: dict[str, str]) -> list[State]:
    """{stage: module} against the lock."""
    lock = read_lock()
    out = []
    for stage, module in stages.items():
        code = declared(stage, module)
        parts = part_digests(code.kernel)
        out.append(State(code, kernel_digest(parts), parts, lock.get(stage)))
    return out


def check(stage: str, module: str) -> None:
    """Stop a stage whose kernel was edited without a version bump or a lock update."""
    problem = states({stage: module})[0].problem()
    if problem:
        raise EagletError(f"{problem} (src/eaglet/{LOCK.name} keeps the kernels' digests)")


def lock(stages: dict[str, str], same_bytes: tuple[str, ...] = ()) -> list[State]:
    """Record each stage's version and kernel digest; a kernel changed without a bump is
    recorded only when named in `same_bytes`. Returns the states recorded."""
    found = states(stages)
    refused = [
        s.problem()
        for s in found
        if s.locked and not s.ok and not s.bumped and s.code.stage not in same_bytes
    ]
    if refused:
        raise EagletError("; ".join(filter(None, refused)))
    entries = {
        s.code.stage: {"version": s.code.version, "digest": s.digest, "parts": s.parts}
        for s in found
    }
    write_json(
        LOCK,
        {
            "about": "each stage's declared code version and kernel digest (eaglet.graph.code)",
            "stages": entries,
        },
    )
    return found
