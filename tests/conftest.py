"""Shared fixtures: a small project directory with its own params file, and the real target."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
FIXTURES = Path(__file__).parent / "fixtures"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")


def write_params(project: Path, data: dict) -> Path:
    path = project / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder with the demo prompt files copied under data/demo/."""
    shutil.copytree(DEMO, tmp_path / "data" / "demo")
    return tmp_path


def tiny_params(**generation) -> dict:
    """Params for quick runs on the embedded target: two small datasets, short answers (cut at
    8 tokens, so kept: `truncated: keep`)."""
    gen = {"backend": "local", "max_new_tokens": 8, "temperature": 0.0, "seed": 0}
    gen["truncated"] = "keep"
    gen.update(generation)
    return {
        "target": {"model": "smollm2-135m-instruct"},
        "backends": {"local": {"kind": "transformers", "batch_size": 8, "threads": 2}},
        "generation": gen,
        "datasets": {
            "sg": {"path": "data/demo/sharegpt.jsonl", "format": "sharegpt", "max_samples": 6},
            "dolly": {"path": "data/demo/dolly.jsonl", "format": "dolly", "max_samples": 4},
        },
        "drafters": {
            "d": {
                "datasets": ["sg", "dolly"],
                "draft_vocab_size": 512,
                "heldout_fraction": 0.4,
                "train": {"ttt_length": 2, "epochs": 2, "batch_size": 2, "lr": 1e-3},
                "evaluate": {"num_steps": [2], "prompts": 2, "max_new_tokens": 6},
            }
        },
    }


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory):
    """The tiny random target, its samples, and a drafter trained on them (a folder)."""
    import torch

    from .hidden_fixture import bundle, fit_tiny, tiny_llama

    torch.set_num_threads(2)
    data = bundle(n=24, new_tokens=24)
    out = tmp_path_factory.mktemp("drafter") / "trained"
    fit_tiny(data, out, epochs=8)
    return tiny_llama(), data, out


def bump_version(text: str) -> str:
    """A stage module's source with its declared code version (`CODE = Code(version=N, ...)`)
    one higher."""
    new, n = re.subn(
        r"(CODE = Code\(\s*version=)(\d+)", lambda m: f"{m[1]}{int(m[2]) + 1}", text, count=1
    )
    assert n == 1, "no CODE = Code(version=...) in this source"
    return new
