"""The train stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglet.device import device_type, resolve_dtype
from eaglet.errors import EagletError
from eaglet.graph.keys import Keys
from eaglet.hashing import file_digest
from eaglet.model import arch
from eaglet.stages.hidden import spec as hidden_spec
from eaglet.stages.train import dflash_spec

NOT_IN_KEY = ("checkpoint_every", "device", "min_supervised_share")  # no output byte
WARM_FILES = ("config.json", "model.safetensors")  # what a warm start reads of its folder


@dataclass(frozen=True)
class TrainSpec:
    """What the trained drafter's bytes depend on (and the vocab and hidden states upstream)."""

    # drafters.<d>.train without NOT_IN_KEY, max_length, device type and dtype resolved, and
    # `mixture`, the weights of a weighted `datasets` ({name: weight})
    train: dict
    heldout_fraction: float
    target: dict  # the frozen embeddings and lm_head come from it
    arch: dict  # resolved: every field, never "from the target"
    arch_differs_from_target: dict


def spec_of(keys: Keys, drafter: str) -> tuple[TrainSpec, dict]:
    p, d = keys.params, keys.params.drafter(drafter)
    train = {k: v for k, v in d["train"].items() if k not in NOT_IN_KEY}
    train["max_length"] = train.get("max_length") or max(map(p.max_length, d["datasets"]))
    if isinstance(d["datasets"], dict):  # weighted: each epoch a mixture (the list form: none)
        train["mixture"] = dict(d["datasets"])
    if "phases" in train:  # every field resolved; the phases' epochs are the run's
        del train["epochs"]
        train["phases"] = [
            {
                "datasets": phase.get("datasets", d["datasets"]),
                "epochs": phase["epochs"],
                "lr_scale": phase.get("lr_scale", 1.0),
                "max_length": phase.get("max_length", train["max_length"]),
            }
            for phase in train["phases"]
        ]
    train["device"] = device_type(d["train"]["device"])
    train["dtype"] = resolve_dtype(d["train"]["dtype"], d["train"]["device"])
    if train.get("select", {}).get("by") == "last":  # the same weights as no select at all
        del train["select"]
    if "init_from" in train:  # the starting drafter's bytes, not where it lies
        where = f"{p.path}: drafters.{drafter}.train.init_from"
        train["init_from"] = warm_digest(p.resolve(train["init_from"]), where)
    text, where, prefix = keys.target_text_config()
    resolved = arch.resolve(text, d["arch"], where, prefix)
    if d["method"] == "dflash":  # only then: an eagle3 drafter's key is that of before
        section = f"{p.path}: drafters.{drafter}.dflash"
        stored = hidden_spec.layer_ids(keys, p.data["hidden"])
        refuse_unsupported(train, f"{p.path}: drafters.{drafter}")
        train["method"] = "dflash"
        train["dflash"] = dflash_spec.resolve(d.get("dflash", {}), text, stored, section, where)
    spec = TrainSpec(
        train=train,
        heldout_fraction=d["heldout_fraction"],
        target=keys.target_identity(),
        arch=resolved,
        arch_differs_from_target=arch.differs(text, resolved),
    )
    upstream = {"vocab": keys.key("vocab", drafter), "hidden": keys.dataset_keys("hidden", drafter)}
    return spec, upstream


# What the DFlash trainer (eaglet.stages.train.dflash) does not do yet: refused by name rather
# than silently trained without.
DFLASH_UNSUPPORTED = {
    "mixture": ("datasets", "weighted datasets"),
    "phases": ("train.phases", "training phases"),
    "select": ("train.select", "checkpoint selection"),
    "init_from": ("train.init_from", "a warm start"),
}


def refuse_unsupported(train: dict, where: str) -> None:
    for key, (field, what) in DFLASH_UNSUPPORTED.items():
        if key in train:
            raise EagletError(f"{where}.{field}: {what} is not supported with method dflash yet")
    for field in ("processes", "grad_accum"):
        if train.get(field, 1) > 1:
            raise EagletError(
                f"{where}.train.{field}: {train[field]}; method dflash trains in one process "
                "without accumulation yet"
            )


def warm_digest(folder: Path, where: str) -> dict:
    """SHA-256 of each file a warm start reads from `folder` (eaglet.stages.train.warm_start)."""
    if not folder.is_dir():
        raise EagletError(f"{where}: {folder}: no such drafter folder")
    out = {}
    for name in WARM_FILES:
        try:
            out[name] = file_digest(folder / name)
        except FileNotFoundError:
            raise EagletError(f"{where}: {folder}: no {name} (not a drafter folder)") from None
    return out
