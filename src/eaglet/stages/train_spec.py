"""The train stage's spec: what its output's bytes depend on, resolved once from params
(`spec_of`). Kept apart from the stage's run so that computing keys imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.device import device_type, resolve_dtype
from eaglet.graph.keys import Keys
from eaglet.model import arch

NOT_IN_KEY = ("checkpoint_every", "device", "min_supervised_share")  # no output byte


@dataclass(frozen=True)
class TrainSpec:
    """What the trained drafter's bytes depend on (and the vocab and hidden states upstream)."""

    train: dict  # drafters.<d>.train without NOT_IN_KEY, max_length, device type and dtype resolved
    heldout_fraction: float
    target: dict  # the frozen embeddings and lm_head come from it
    arch: dict  # resolved: every field, never "from the target"
    arch_differs_from_target: dict


def spec_of(keys: Keys, drafter: str) -> tuple[TrainSpec, dict]:
    p, d = keys.params, keys.params.drafter(drafter)
    train = {k: v for k, v in d["train"].items() if k not in NOT_IN_KEY}
    train["max_length"] = train.get("max_length") or max(map(p.max_length, d["datasets"]))
    train["device"] = device_type(d["train"]["device"])
    train["dtype"] = resolve_dtype(d["train"]["dtype"], d["train"]["device"])
    text, where, prefix = keys.target_text_config()
    resolved = arch.resolve(text, d["arch"], where, prefix)
    spec = TrainSpec(
        train=train,
        heldout_fraction=d["heldout_fraction"],
        target=keys.target_identity(),
        arch=resolved,
        arch_differs_from_target=arch.differs(text, resolved),
    )
    upstream = {"vocab": keys.key("vocab", drafter), "hidden": keys.dataset_keys("hidden", drafter)}
    return spec, upstream
