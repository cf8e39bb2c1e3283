"""Which samples each optimizer step trains on: the training split cut or skipped at
max_length (overlong), the run's phases and mixture weights, and Steps, the order of every
epoch as a function of the seed, the epoch and the process count (so a resumed or DDP run sees
the same batches)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from eaglet.errors import EagletError
from eaglet.model import ttt
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import mixture
from eaglet.stages.train.spec import TrainHyper, TrainPhase


def overlong(readers: list, refs: list, cap: int, policy: str) -> tuple[list, dict]:
    """The samples of `refs` longer than `cap` (max_length) are cut there (`policy`, as
    train.overlong: truncate) or left out (skip): the refs trained, and how many samples and
    tokens that cost."""
    tokens = {
        (i, s["id"]): s["tokens"] for i, r in enumerate(readers) for s in r.manifest["samples"]
    }
    long = [r for r in refs if tokens[r] > cap]
    lost = sum(tokens[r] - (cap if policy == "truncate" else 0) for r in long)
    if policy == "skip":
        refs = [r for r in refs if tokens[r] <= cap]
    return refs, {"policy": policy, "samples": len(long), "tokens_lost": lost}


@dataclass(frozen=True)
class Phase:
    """A stretch of a run (train.phases): its training samples, their mixture (`weights`, one
    per reader; None: each sample once an epoch), its epochs, length cap and lr scale."""

    train: list
    weights: list | None
    epochs: int
    max_length: int
    lr_scale: float = 1.0


@dataclass(eq=False)
class Steps:
    """Which samples each optimizer step trains on: a function of the seed, the epoch and the
    process count only, so a resumed run sees the same order. `weights` (one per reader, from a
    weighted `datasets`) make each epoch a mixture (eaglet.stages.train.mixture); without them an
    epoch is every training sample once. With `phases` (train.phases) the run is its phases in
    order, epochs numbered on across them; without, one phase of `train` and `weights`."""

    train: list  # every sample some phase trains on, in reader order
    held: list
    per_step: int  # samples in one global batch (batch_size x grad_accum x processes)
    total: int
    seed: int
    run: ttt.Run
    weights: list | None = None
    phases: list[Phase] | None = None
    _order: dict[tuple[int, int], list] = field(default_factory=dict)  # the current epoch's
    _tokens: dict | None = None  # each sample's tokens, for `count`

    @property
    def stretches(self) -> list[Phase]:
        if self.phases is not None:
            return self.phases
        return [Phase(self.train, self.weights, 0, 0)]  # epochs: as many as total allows

    def steps_per_epoch(self, phase: Phase) -> int:
        return len(phase.train) // self.per_step

    @property
    def per_epoch(self) -> int:
        """Optimizer steps in an epoch (of the first phase)."""
        return self.steps_per_epoch(self.stretches[0])

    def locate(self, step: int) -> tuple[int, int, int]:
        """(phase, epoch counted over the whole run, batch within the epoch) of `step`."""
        epochs, stretches = 0, self.stretches
        for p, phase in enumerate(stretches):
            n = self.steps_per_epoch(phase)
            if p == len(stretches) - 1 or step < n * phase.epochs:
                epoch, index = divmod(step, n)
                return p, epochs + epoch, index
            step, epochs = step - n * phase.epochs, epochs + phase.epochs
        raise AssertionError("unreachable")

    def phase(self, step: int) -> Phase:
        return self.stretches[self.locate(step)[0]]

    def lr_scale(self, step: int) -> float:
        return self.phase(step).lr_scale if self.phases is not None else 1.0

    def order(self, epoch: int, p: int = 0) -> list:
        """Epoch `epoch`'s order (of phase `p`, the one that epoch is in)."""
        if (p, epoch) not in self._order:
            phase, seed = self.stretches[p], self.seed * 100_003 + epoch
            if phase.weights is None:
                order = list(phase.train)
                random.Random(seed).shuffle(order)
            else:  # exactly the samples the epoch's steps train, per dataset by weight
                size = self.steps_per_epoch(phase) * self.per_step
                order = mixture.order(phase.train, phase.weights, size, seed)
            self._order = {(p, epoch): order}
        return self._order[(p, epoch)]

    def batch(self, step: int) -> list:
        """The step's global batch."""
        p, epoch, index = self.locate(step)
        return self.order(epoch, p)[index * self.per_step : (index + 1) * self.per_step]

    def mine(self, step: int) -> list:
        """This process's share of the step's global batch."""
        refs = self.batch(step)
        rank, world = self.run.rank, self.run.world
        return refs[rank * len(refs) // world : (rank + 1) * len(refs) // world]

    def epoch_end(self, step: int) -> bool:
        p, _, index = self.locate(step)
        return index == self.steps_per_epoch(self.stretches[p]) - 1

    def reads(self, start: int):
        """The samples this process reads, in order (an online reader fetches them ahead)."""
        for step in range(start, self.total):
            yield from self.mine(step)
            if self.epoch_end(step) and self.run.rank == 0:
                yield from self.held
        if self.run.rank == 0:
            yield from self.held

    def count(self, readers: list, hp: TrainHyper, steps, parts: list | None = None) -> list[dict]:
        """Add what `steps` (step numbers) trained to `parts` (new when None): per phase (one
        without train.phases) its steps, and per dataset its samples (repeats counted), tokens
        (each cut at the phase's max_length) and the steps it had a sample in; its weight, if
        weighted."""
        names = dataset_names(readers, hp)
        if parts is None:
            parts = []
            for phase in self.stretches:
                ws = phase.weights or [None] * len(names)
                zero = {"samples": 0, "tokens": 0, "steps": 0}
                rows = {
                    n: ({"weight": w} if w is not None else {}) | zero
                    for n, w in zip(names, ws, strict=True)
                }
                parts.append({"steps": 0, "datasets": rows})
        if self._tokens is None:
            self._tokens = {
                (i, s["id"]): s["tokens"]
                for i, r in enumerate(readers)
                for s in r.manifest["samples"]
            }
        for step in steps:
            p = self.locate(step)[0]
            cap = self.stretches[p].max_length if self.phases is not None else hp.max_length
            parts[p]["steps"] += 1
            mixture.tally([self.batch(step)], names, self._tokens, cap, parts[p]["datasets"])
        return parts

    def seen(self, parts: list[dict]) -> dict[str, dict]:
        """Per dataset what the counted `parts` trained, over all phases."""
        if len(parts) == 1:
            return parts[0]["datasets"]
        return {
            n: {k: sum(p["datasets"][n][k] for p in parts) for k in ("samples", "tokens", "steps")}
            for n in parts[0]["datasets"]
        }


def dataset_names(readers: list, hp: TrainHyper) -> list[str]:
    """The readers' dataset names: the weighted `datasets`' own, else the readers' manifests'."""
    if hp.mixture is not None:
        return list(hp.mixture)
    return [r.manifest.get("dataset") or f"dataset{i}" for i, r in enumerate(readers)]


def plan_steps(readers: list, hp: TrainHyper, run: ttt.Run) -> tuple[Steps, dict]:
    """The run's steps over the train/held-out split, and what overlong samples cost."""
    split_train, held_refs = hidden_read.split(readers, hp.heldout_fraction)
    train_refs, long_train = overlong(readers, split_train, hp.max_length, hp.policy)
    held_refs, long_held = overlong(readers, held_refs, hp.max_length, hp.policy)
    if long_train["samples"] + long_held["samples"] and run.rank == 0:
        print(
            f"train: {long_train['samples'] + long_held['samples']} samples longer than "
            f"max_length {hp.max_length:,}: {long_train['policy']} "
            f"({long_train['tokens_lost'] + long_held['tokens_lost']:,} tokens not trained)",
            file=sys.stderr,
        )
    per_step = hp.batch_size * hp.grad_accum * run.world
    long = {"train": long_train, "heldout": long_held}
    if hp.phases is not None:
        phases, long["phases"] = plan_phases(readers, split_train, hp, per_step)
        total = capped(sum(len(ph.train) // per_step * ph.epochs for ph in phases), hp)
        used = {r for ph in phases for r in ph.train}
        train_refs = [r for r in split_train if r in used]
        steps = Steps(train_refs, held_refs, per_step, total, hp.seed, run, None, phases)
        return steps, long
    if len(train_refs) < per_step:
        raise EagletError(
            f"{len(train_refs)} training samples, fewer than one global batch ({per_step})"
        )
    weights = None
    if hp.mixture is not None:  # datasets: {name: weight}
        names, weights = list(hp.mixture), list(hp.mixture.values())
        if len(weights) != len(readers):
            raise EagletError(f"train: {len(readers)} readers for the datasets {names}")
        if (name := mixture.empty(names, weights, train_refs)) is not None:
            raise EagletError(
                f"datasets.{name}: weight {hp.mixture[name]} but no training sample (all "
                "held out or skipped as overlong): give it weight 0 or more samples"
            )
    total = capped(len(train_refs) // per_step * hp.epochs, hp)
    steps = Steps(train_refs, held_refs, per_step, total, hp.seed, run, weights)
    return steps, long


def capped(total: int, hp: TrainHyper) -> int:
    """The run's optimizer steps: `total`, at most train.max_steps."""
    return min(total, hp.max_steps) if hp.max_steps else total


def plan_phases(
    readers: list, split_train: list, hp: TrainHyper, per_step: int
) -> tuple[list[Phase], list]:
    """train.phases as Phases over the training split: each its datasets' samples (cut or
    skipped at its max_length), and what its overlong samples cost."""
    names = dataset_names(readers, hp)
    phases, long = [], []
    for k, ph in enumerate(hp.phases):
        phase, cut = plan_phase(readers, split_train, names, ph, hp.policy, f"train.phases.{k}")
        if len(phase.train) < per_step:
            raise EagletError(
                f"train.phases.{k}: {len(phase.train)} training samples, fewer than one global "
                f"batch ({per_step})"
            )
        phases.append(phase)
        long.append(cut)
    return phases, long


def plan_phase(
    readers: list, split_train: list, names: list[str], ph: TrainPhase, policy: str, where: str
) -> tuple[Phase, dict]:
    """One phase over the training split (its datasets' samples, cut or skipped at its
    max_length) and what its overlong samples cost; `where` names it in errors."""
    wanted = ph.datasets
    for name in wanted:
        if name not in names:
            raise EagletError(
                f"{where}.datasets.{name}: the drafter does not read dataset '{name}' "
                f"(it reads {', '.join(names)})"
            )
    read = {names.index(n) for n in wanted}
    refs, cut = overlong(readers, [r for r in split_train if r[0] in read], ph.max_length, policy)
    weights = [wanted.get(n, 0) for n in names] if isinstance(wanted, dict) else None
    if weights is not None and (name := mixture.empty(names, weights, refs)) is not None:
        raise EagletError(
            f"{where}.datasets.{name}: weight {wanted[name]} but no training sample (all held "
            "out or skipped as overlong): give it weight 0 or more samples"
        )
    return Phase(refs, weights, ph.epochs, ph.max_length, ph.lr_scale), cut
