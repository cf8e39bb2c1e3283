"""The training run's state (Trainer) and its checkpoint: what a rerun needs to continue at a
step, written atomically by rank 0, and read back (model, optimizer, schedule, data position,
RNG states)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from eaglet.atomic import atomic_path
from eaglet.errors import EagletError
from eaglet.formats.io import write_json
from eaglet.model import ttt

if TYPE_CHECKING:
    from eaglet.model.drafter import Drafter
    from eaglet.model.target_head import TargetHead
    from eaglet.stages.train.data import Steps
    from eaglet.stages.train.spec import TrainHyper


@dataclass
class Trainer:
    """The drafter, its frozen target head, the optimizer and schedule, and the logs so far."""

    model: Drafter
    ddp: torch.nn.Module  # the model, or its DDP wrapper
    head: TargetHead
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    warm: dict | None = None  # what a warm start copied
    best: dict | None = None  # train.select: the best epoch end so far, and its weights
    rows: list[dict] = field(default_factory=list)
    held_rows: list[dict] = field(default_factory=list)

    @property
    def trainable(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]


def resume(ckpt: Path, t: Trainer, hp: TrainHyper, run: ttt.Run) -> int:
    """Restore `t` and the RNGs from the checkpoint if there is one: the step to start at."""
    if not ckpt.exists():
        return 0
    try:
        state = torch.load(ckpt, map_location=run.device, weights_only=False)
    except Exception as e:  # a torn or damaged file: torch raises several kinds
        raise EagletError(
            f"{ckpt}: unreadable checkpoint ({type(e).__name__}); delete it to train from the start"
        ) from None
    if state["hp"] != hp.as_dict() or state["world"] != run.world:
        raise EagletError(f"{ckpt}: checkpoint of a different run (params or processes)")
    t.model.load_state_dict(state["model"])
    t.opt.load_state_dict(state["optimizer"])
    t.sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    t.rows, t.held_rows, t.best = state["rows"], state["heldout"], state.get("best")
    return state["step"]


def save_checkpoint(
    ckpt: Path, t: Trainer, step: int, steps: Steps, hp: TrainHyper, seen: dict | None = None
) -> None:
    """Everything a rerun needs to continue at `step` (rank 0 writes it, atomically); `seen`,
    what each dataset trained so far, goes beside it for `eaglet status`."""
    if steps.run.rank != 0:
        return
    state = {
        "hp": hp.as_dict(),  # plain data: a checkpoint loads without this module's classes
        "world": steps.run.world,
        "step": step,
        "data_position": dict(zip(("phase", "epoch", "batch"), steps.locate(step), strict=True)),
        "model": t.model.state_dict(),
        "optimizer": t.opt.state_dict(),
        "scheduler": t.sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "rows": t.rows,
        "heldout": t.held_rows,
        "best": t.best,
    }
    with atomic_path(ckpt) as tmp:
        torch.save(state, tmp)
    # how far it got, for `eaglet status` (reading the checkpoint itself would load it all)
    info = {"step": step, "total": steps.total} | ({"datasets": seen} if seen else {})
    write_json(ckpt.with_name("checkpoint.json"), info)
