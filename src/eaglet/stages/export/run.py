"""The export stage's run: the trained drafter loaded, written in the engine's format
(eaglet.formats.exports), checked against the checkpoint, with the serve command beside."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from eaglet.atomic import atomic_path
from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.dflash import is_dflash
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import write_json
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.stages.export.kernel import validate
from eaglet.stages.export.spec import ExportSpec


def serve_command(fmt: str, target: str, draft: str, num_steps: int = 3) -> str:
    """The engine's launch command for the target with this draft, chain drafting (paths
    relative to the project root, where it is meant to run)."""
    if fmt == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
            "--speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(draft)} "
            f"--speculative-num-steps {num_steps} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {num_steps + 1}"
        )
    spec = json.dumps(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": num_steps},
        separators=(",", ":"),
    )
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


@dataclass(frozen=True)
class Setup:
    """Beside the spec: the trained drafter, the project root (what the export's paths are
    relative to)."""

    trained: Path
    root: Path


def setup(keys: Keys, spec: Spec[ExportSpec]) -> Setup:
    return Setup(keys.path("train", spec.name), keys.params.root)


def run(spec: Spec[ExportSpec], setup: Setup, out: Path) -> tuple[Path, str]:
    """Write and validate the export `spec` describes at `out`; (path, serving command)."""
    if not setup.trained.exists():
        raise EagletError(f"drafters.{spec.name}: not trained yet: {setup.trained}")
    from eaglet.stages.export import dflash as export_dflash

    if is_dflash(setup.trained):  # method dflash: z-lab's layout, both engines
        return export_dflash.run(spec, setup, out)
    model = load_drafter(setup.trained)
    v = spec.values
    name = v.verifier
    if name.startswith("./"):  # a folder of the project: named relative to the export itself
        name = os.path.relpath(setup.root / name, out.resolve())
    verifier = {"name_or_path": name, "architectures": v.verifier_architectures}
    draft = os.path.relpath(out.resolve(), setup.root.resolve())
    command = serve_command(v.format, v.verifier, draft, v.num_steps)
    with atomic_path(out, directory=True) as tmp:
        exports.write(model, v.format, tmp, verifier, v.num_steps, v.arch_differs_from_target)
        report = validate(tmp, model)
        write_json(
            sidecar_of(out), {"provenance": spec.provenance(), "stats": report | {"serve": command}}
        )
    return out, command
