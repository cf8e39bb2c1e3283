"""The train stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from functools import cached_property
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
class Select:
    """train.select, when it is not `by: last`: the epoch end whose offline acceptance length
    (a chain of `num_steps` drafts over the held-out split) is highest gives the weights."""

    by: str
    num_steps: int


@dataclass(frozen=True)
class TrainPhase:
    """One of train.phases, every field resolved (eaglet.stages.train.data.plan_phases)."""

    datasets: tuple[str, ...] | dict[str, float]  # a list: each sample once; names: weights
    epochs: int
    lr_scale: float
    max_length: int


@dataclass(frozen=True)
class DFlashSection:
    """drafters.<d>.dflash resolved (eaglet.stages.train.dflash_spec.resolve)."""

    block_size: int
    num_layers: int
    anchors: int
    gamma: float
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int


@dataclass(frozen=True)
class TrainHyper:
    """The hyperparameters the trainer reads: the spec's `train` dict and its held-out fraction,
    typed. A field the dict leaves out is None, and `as_dict` leaves it out again, so the dict
    round-trips (the checkpoint compares it; the key hashes the spec's dict itself)."""

    ttt_length: int
    step_weight: float
    batch_size: int
    grad_accum: int
    processes: int
    lr: float
    min_lr_ratio: float
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    dtype: str  # resolved: float32 or bfloat16
    seed: int
    max_length: int  # resolved: the drafter's datasets' longest when not set
    device: str  # the resolved device type
    heldout_fraction: float
    epochs: int | None = None  # None with phases: theirs are the run's
    max_steps: int | None = None
    overlong: str | None = None  # truncate or skip; None: truncate
    mixture: dict[str, float] | None = None  # a weighted `datasets`: {name: weight}
    phases: tuple[TrainPhase, ...] | None = None
    select: Select | None = None
    init_from: dict[str, str] | None = None  # the warm start's files: {name: SHA-256}
    method: str | None = None  # dflash; None: EAGLE-3
    dflash: DFlashSection | None = None

    @classmethod
    def of(cls, hp: dict) -> TrainHyper:
        """From the trainer's dict: the spec's `train` with `heldout_fraction`."""
        typed = dict(hp)
        if "phases" in typed:
            typed["phases"] = tuple(TrainPhase(**_tuples(ph)) for ph in typed["phases"])
        if "select" in typed:
            typed["select"] = Select(**typed["select"])
        if "dflash" in typed:
            typed["dflash"] = DFlashSection(**_tuples(typed["dflash"]))
        return cls(**typed)

    @property
    def policy(self) -> str:
        """What happens to a sample longer than max_length: truncate (the default) or skip."""
        return self.overlong or "truncate"

    def as_dict(self) -> dict:
        """The dict `of` was given (fields that are None left out; tuples as lists)."""
        return _plain(self)


def _tuples(d: dict) -> dict:
    """`d` with its lists as tuples (a frozen record's sequences)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if is_dataclass(value):
        pairs = ((f.name, getattr(value, f.name)) for f in fields(value))
        return {k: _plain(v) for k, v in pairs if v is not None}
    return value


@dataclass(frozen=True)
class TrainSpec:
    """What the trained drafter's bytes depend on (and the vocab and hidden states upstream)."""

    # drafters.<d>.train without NOT_IN_KEY, max_length, device type and dtype resolved, and
    # `mixture`, the weights of a weighted `datasets` ({name: weight}): the key hashes this
    # dict as it is; the run reads it typed (`hyper`)
    train: dict
    heldout_fraction: float
    target: dict  # the frozen embeddings and lm_head come from it
    arch: dict  # resolved: every field, never "from the target"
    arch_differs_from_target: dict

    @cached_property
    def hyper(self) -> TrainHyper:
        return TrainHyper.of(self.train | {"heldout_fraction": self.heldout_fraction})


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
