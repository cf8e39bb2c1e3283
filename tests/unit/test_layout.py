"""The code's layout, read with `ast` (nothing of eaglet or torch imported): every stage is a
package of the same four files, and imports only what lies below it (house-review §4).

- `stages/<s>/` holds `__init__.py` (with `CODE = Code(...)`), `spec.py`, `kernel.py`, `run.py`;
- a stage imports lower layers (eaglet.formats, model, engines, graph, ...) and, of the other
  stages, only the `spec` or `read` module of an upstream one: never a downstream stage, nor
  another stage's `run` or `kernel`;
- `spec.py` imports no torch (keys and Snakemake import it);
- `kernel.py` imports no `eaglet.engines`, no `subprocess`, and reads no `os.environ`.
Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ..conftest import ROOT

STAGES = ROOT / "src" / "eaglet" / "stages"
ORDER = {
    "prompts": 0,
    "responses": 1,
    "hidden": 2,
    "vocab": 3,
    "train": 4,
    "evaluate": 5,
    "export": 5,
}
SHARED = {"spec", "read"}  # what a stage may import of an upstream stage


def packages() -> list[Path]:
    return sorted(p for p in STAGES.iterdir() if p.is_dir() and p.name != "__pycache__")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, those inside functions included; `from a
    import b` counts as a.b too, so that `from eaglet.stages.hidden import read` is seen."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_stages_are_the_packages_of_the_order():
    assert sorted(p.name for p in packages()) == sorted(ORDER)


@pytest.mark.parametrize("pkg", packages(), ids=lambda p: p.name)
def test_a_stage_holds_its_four_files(pkg):
    missing = [
        f for f in ("__init__.py", "spec.py", "kernel.py", "run.py") if not (pkg / f).is_file()
    ]
    assert not missing, f"stages/{pkg.name}: no {', '.join(missing)}"
    tree = ast.parse((pkg / "__init__.py").read_text())
    assert any(
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["CODE"]
        for n in tree.body
    ), f"stages/{pkg.name}/__init__.py: no CODE = Code(...)"


@pytest.mark.parametrize("pkg", packages(), ids=lambda p: p.name)
def test_a_stage_imports_only_upstream_specs_and_readers(pkg):
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        for line, module in imports(path):
            parts = module.split(".")
            if parts[:2] != ["eaglet", "stages"] or len(parts) < 3 or parts[2] == pkg.name:
                continue
            other = parts[2]
            if other not in ORDER:
                continue  # eaglet.stages itself
            part = parts[3] if len(parts) > 3 else None
            if ORDER[other] >= ORDER[pkg.name]:
                bad.append(f"{where(path, line)}: {module}: {other} is not upstream of {pkg.name}")
            elif part is not None and part not in SHARED:
                bad.append(f"{where(path, line)}: {module}: only {other}'s spec or read")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pkg", packages(), ids=lambda p: p.name)
def test_a_spec_imports_no_torch(pkg):
    path = pkg / "spec.py"
    bad = [where(path, n) for n, m in imports(path) if m.split(".")[0] == "torch"]
    assert not bad, f"{', '.join(bad)}: spec.py imports torch"


@pytest.mark.parametrize("pkg", packages(), ids=lambda p: p.name)
def test_a_kernel_starts_no_process_and_reads_no_environment(pkg):
    path = pkg / "kernel.py"
    bad = [
        f"{where(path, n)}: imports {m}"
        for n, m in imports(path)
        if m.startswith("eaglet.engines") or m.split(".")[0] == "subprocess"
    ]
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv")
            and getattr(node.value, "id", None) == "os"
        ):
            bad.append(f"{where(path, node.lineno)}: reads os.{node.attr}")
    assert not bad, "\n".join(bad)
