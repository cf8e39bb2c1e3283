"""The export stages (sglang, vllm): a trained drafter written as an SGLang draft folder or a
speculators (vLLM) one (the formats: eaglet.formats.exports), each checked by a validator that
reloads it from its files alone.

The validator checks every required field and tensor, their shapes and the vocab maps, then
runs a probe through the reloaded drafter and the trained one and requires the same outputs.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats import exports
from eaglet.formats.atomic import atomic_path
from eaglet.formats.dflash import is_dflash
from eaglet.formats.drafter import load_drafter
from eaglet.formats.io import write_json
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model.drafter import Drafter
from eaglet.stages.export_spec import ExportSpec

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.formats.exports:layer_config",
        "eaglet.formats.exports:mla_layer_config",
        "eaglet.formats.exports:mla_config",
        "eaglet.formats.exports:sglang_config",
        "eaglet.formats.exports:_provenance",
        "eaglet.formats.exports:vllm_config",
        "eaglet.formats.exports:tensors",
        "eaglet.formats.exports:write",
        "eaglet.model.drafter",
        "eaglet.formats.drafter:load_drafter",
        # method dflash
        "eaglet.model.dflash.export",
        "eaglet.stages.export_dflash:validate",
        "eaglet.formats.dflash:load_dflash",
    ),
)


PROBE_STEPS = 3


def probe(model: Drafter, seed: int = 0) -> list[torch.Tensor]:
    """Draft logits of a fixed random input over PROBE_STEPS chained steps."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    aux = torch.randn(1, 24, len(cfg.aux_layer_ids), cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=g)
    with torch.no_grad():
        return model(aux, ids, PROBE_STEPS)


def validate(folder: Path, reference: Drafter) -> dict:
    """Reload `folder` from its files alone and check it against the trained `reference`:
    config fields, tensors, vocab maps, and the same draft outputs on a probe. Raises
    EagletError on the first problem; returns what was checked."""
    folder = Path(folder)
    fmt, model = exports.load_export(folder, reference.embed_tokens.weight)
    ref = reference.cfg
    if model.cfg != ref:
        mine, theirs = asdict(model.cfg), asdict(ref)
        diff = {k: (v, theirs[k]) for k, v in mine.items() if theirs[k] != v}
        raise EagletError(f"{folder}/config.json: differs from the trained drafter: {diff}")
    # the trained weights as the export stores them (SGLang's embeddings stay the target's)
    stored = {exports._internal(n): t for n, t in exports.tensors(reference, fmt).items()}
    rounded = Drafter(ref)
    rounded.load_state_dict(
        {n: stored[n].float() if n in stored else t for n, t in reference.state_dict().items()}
    )
    got, want, exact = probe(model), probe(rounded.eval()), probe(reference.eval())
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            err = float((a - b).abs().max())
            raise EagletError(f"{folder}: step {k} outputs differ from the trained drafter ({err})")
    agree = [
        float((a.argmax(-1) == b.argmax(-1)).float().mean())
        for a, b in zip(got, exact, strict=True)
    ]
    return {
        "format": fmt,
        "tensors": len(exports.expected_shapes(ref, fmt)),
        "aux_layer_ids": list(
            ref.aux_layer_ids if fmt == "sglang" else [i + 1 for i in ref.aux_layer_ids]
        ),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)),
        "top1_agreement_vs_fp32": agree,
    }


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
    from eaglet.stages import export_dflash

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
