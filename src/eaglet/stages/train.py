"""The train stage: EAGLE-3 training-time test (TTT) on stored target hidden states.

The target's next-token distribution p[t] is recomputed on the fly from the stored final state
through the target's frozen lm_head and restricted to the draft vocab (full logits are never
stored). The drafter unrolls `ttt_length` chained steps at every position (Drafter.forward):
step k at position t predicts token t+k+2, so its target is p[t+k+1], and it counts where
loss_mask[t+k+2] holds (an assistant token) and the target's argmax is in the draft vocab:

    loss = sum_k step_weight**k * sum_valid CE(p, q_k) / N_k      N_k = valid positions, step k

N_k counts the whole optimizer step (every micro-batch of every process), so gradient
accumulation and DDP give exactly the gradient of one big batch. AdamW, linear warmup then
cosine decay, gradient clipping, fp32 or bf16 autocast. Every `checkpoint_every` steps the model,
optimizer, scheduler, data position and RNG states go to a work directory beside the output; a
rerun resumes there. Under `torchrun` it runs DDP (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglet.errors import EagletError
from eaglet.formats.atomic import atomic_path
from eaglet.formats.drafter import save_drafter
from eaglet.formats.io import write_json
from eaglet.formats.vocab import load_vocab
from eaglet.graph.code import Code
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model import train_memory, ttt
from eaglet.model.drafter import Drafter, DrafterConfig
from eaglet.model.target import TargetSpec, load_head, pick_device
from eaglet.model.target_head import TargetHead
from eaglet.progress import BEACON, Progress
from eaglet.stages import drafter_data, mixture, warm_start
from eaglet.stages.train_spec import TrainSpec, warm_digest

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.model.ttt:step_masks",
        "eaglet.model.ttt:at",
        "eaglet.model.ttt:scorer",
        "eaglet.stages.train:overlong",
        "eaglet.stages.train:lr_factor",
        "eaglet.model.ttt:Run",
        "eaglet.model.ttt:prepare",
        "eaglet.model.ttt:ttt_batch",
        "eaglet.stages.train:heldout",
        "eaglet.stages.train:Steps",
        "eaglet.stages.train:plan_steps",
        "eaglet.stages.train:plan_phases",
        "eaglet.stages.train:Phase",
        "eaglet.stages.train:dataset_names",
        "eaglet.stages.mixture",
        "eaglet.stages.train:make_trainer",
        "eaglet.stages.train:train_step",
        "eaglet.stages.train:fit",
        "eaglet.formats.drafter:save_drafter",
        "eaglet.model.drafter",
        "eaglet.model.target_head",
        "eaglet.model.arch",
        "eaglet.stages.drafter_data:is_heldout",
        "eaglet.stages.drafter_data:split",
        "eaglet.model.ttt:collate",
        "eaglet.model.ttt:load",
        "eaglet.formats.vocab:load_vocab",
        "eaglet.stages.warm_start:start_from",
        "eaglet.model.ttt:chain_accepted",
        "eaglet.model.ttt:accepted_counts",
        "eaglet.stages.train:offline_acceptance",
        "eaglet.stages.train:select",
        # method dflash
        "eaglet.model.dflash.config",
        "eaglet.model.dflash.model",
        "eaglet.model.dflash.loss",
        "eaglet.model.dflash.train",
        "eaglet.stages.train_dflash",
        "eaglet.formats.dflash",
    ),
)


def overlong(readers: list, refs: list, hp: dict) -> tuple[list, dict]:
    """The samples of `refs` longer than max_length are cut there (train.overlong: truncate)
    or left out (skip): the refs trained, and how many samples and tokens that cost."""
    cap, policy = hp["max_length"], hp.get("overlong", "truncate")
    tokens = {
        (i, s["id"]): s["tokens"] for i, r in enumerate(readers) for s in r.manifest["samples"]
    }
    long = [r for r in refs if tokens[r] > cap]
    lost = sum(tokens[r] - (cap if policy == "truncate" else 0) for r in long)
    if policy == "skip":
        refs = [r for r in refs if tokens[r] <= cap]
    return refs, {"policy": policy, "samples": len(long), "tokens_lost": lost}


def check_fits(readers: list, names: list[str], cfg: DrafterConfig, hp: dict, memory: int) -> None:
    """Before training on a GPU of `memory` bytes: a one-line error naming the dataset and the
    length when its longest sample (as trained: cut at max_length, or skipped) would not fit,
    by eaglet.model.train_memory's estimate."""
    shape = train_memory.Shape.of(
        cfg.to_dict(),
        cfg.target_hidden_size,
        cfg.vocab_size,
        cfg.draft_vocab_size,
        hp["ttt_length"],
    )
    bs, gib = hp["batch_size"], train_memory.GIB
    most = train_memory.longest(shape, memory, hp["dtype"]) // bs
    for name, r in zip(names, readers, strict=True):
        lengths = [s["tokens"] for s in r.manifest["samples"]]
        if hp.get("overlong") == "skip":
            lengths = [n for n in lengths if n <= hp["max_length"]]
        t = min(max(lengths, default=0), hp["max_length"])
        if t > most:
            peak = train_memory.estimate(shape, bs * t, hp["dtype"])["peak"]
            raise EagletError(
                f"dataset {name}: a sample of {t:,} tokens (batch {bs}) needs about "
                f"{peak / gib:.1f} GiB per GPU to train, this GPU has {memory / gib:.1f} GiB; "
                f"the longest that fits is {most:,} tokens: lower train.max_length "
                "(train.overlong: truncate or skip)"
            )


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def heldout(model: Drafter, readers, refs, hp: dict, head: TargetHead, run: ttt.Run) -> dict:
    """Mean per-step loss and top-1 accuracy on held-out samples."""
    steps = hp["ttt_length"]
    ce, hits, n = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    bs = hp["batch_size"]
    with torch.no_grad():
        for i in range(0, len(refs), bs):
            batch = ttt.load(readers, refs[i : i + bs], hp["max_length"])
            b = ttt.prepare(batch, head, steps, run.device, refs[i : i + bs])
            c, h = ttt.ttt_batch(model, b, steps, head, run)
            ce, hits = ce + c.cpu(), hits + h.cpu()
            n += torch.stack([m.sum() for m in b["masks"]]).float().cpu()
    n = n.clamp(min=1)
    return {"loss": (ce / n).tolist(), "acc": (hits / n).tolist(), "positions": int(n[0])}


def offline_acceptance(model: Drafter, readers, refs, hp: dict, head: TargetHead, run) -> float:
    """Offline acceptance length of `select.num_steps` chained drafts over the samples `refs`:
    1 + the mean accepted count over every answer start position."""
    steps = hp["select"]["num_steps"]
    n = ttt.accepted_counts(
        model, readers, refs, head, steps, run, hp["batch_size"], hp["max_length"]
    )
    return float(1 + n.float().mean()) if len(n) else 1.0


def select(t: Trainer, readers, held: list, hp: dict, run: ttt.Run, step: int, epoch: int) -> None:
    """At an epoch end: the offline acceptance on the held-out split goes to the epoch's row of
    heldout.csv; the weights are kept when it is the best so far (the earliest on a tie)."""
    value = offline_acceptance(t.model, readers, held, hp, t.head, run)
    t.held_rows[-1]["offline_acceptance_length"] = value
    if t.best is None or value > t.best["value"]:
        state = {  # the frozen embeddings (the target's: 4.7 GB for Kimi) never change
            k: v.detach().cpu().clone()
            for k, v in t.model.state_dict().items()
            if k != "embed_tokens.weight"
        }
        t.best = {"step": step + 1, "epoch": epoch, "value": value, "state": state}


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
    weighted `datasets`) make each epoch a mixture (eaglet.stages.mixture); without them an
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

    def count(self, readers: list, hp: dict, steps, parts: list | None = None) -> list[dict]:
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
            cap = self.stretches[p].max_length if self.phases is not None else hp["max_length"]
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


def dataset_names(readers: list, hp: dict) -> list[str]:
    """The readers' dataset names: the weighted `datasets`' own, else the readers' manifests'."""
    if "mixture" in hp:
        return list(hp["mixture"])
    return [r.manifest.get("dataset") or f"dataset{i}" for i, r in enumerate(readers)]


def plan_steps(readers: list, hp: dict, run: ttt.Run) -> tuple[Steps, dict]:
    """The run's steps over the train/held-out split, and what overlong samples cost."""
    split_train, held_refs = drafter_data.split(readers, hp["heldout_fraction"])
    train_refs, long_train = overlong(readers, split_train, hp)
    held_refs, long_held = overlong(readers, held_refs, hp)
    if long_train["samples"] + long_held["samples"] and run.rank == 0:
        print(
            f"train: {long_train['samples'] + long_held['samples']} samples longer than "
            f"max_length {hp['max_length']:,}: {long_train['policy']} "
            f"({long_train['tokens_lost'] + long_held['tokens_lost']:,} tokens not trained)",
            file=sys.stderr,
        )
    per_step = hp["batch_size"] * hp["grad_accum"] * run.world
    long = {"train": long_train, "heldout": long_held}
    if "phases" in hp:
        phases, long["phases"] = plan_phases(readers, split_train, hp, per_step)
        total = sum(len(ph.train) // per_step * ph.epochs for ph in phases)
        if hp.get("max_steps"):
            total = min(total, hp["max_steps"])
        used = {r for ph in phases for r in ph.train}
        train_refs = [r for r in split_train if r in used]
        steps = Steps(train_refs, held_refs, per_step, total, hp["seed"], run, None, phases)
        return steps, long
    if len(train_refs) < per_step:
        raise EagletError(
            f"{len(train_refs)} training samples, fewer than one global batch ({per_step})"
        )
    weights = None
    if "mixture" in hp:  # datasets: {name: weight}
        names, weights = list(hp["mixture"]), list(hp["mixture"].values())
        if len(weights) != len(readers):
            raise EagletError(f"train: {len(readers)} readers for the datasets {names}")
        if (name := mixture.empty(names, weights, train_refs)) is not None:
            raise EagletError(
                f"datasets.{name}: weight {hp['mixture'][name]} but no training sample (all "
                "held out or skipped as overlong): give it weight 0 or more samples"
            )
    total = len(train_refs) // per_step * hp["epochs"]
    if hp.get("max_steps"):
        total = min(total, hp["max_steps"])
    steps = Steps(train_refs, held_refs, per_step, total, hp["seed"], run, weights)
    return steps, long


def plan_phases(readers: list, split_train: list, hp: dict, per_step: int) -> tuple[list, list]:
    """train.phases as Phases over the training split: each its datasets' samples (cut or
    skipped at its max_length), and what its overlong samples cost."""
    names = dataset_names(readers, hp)
    phases, long = [], []
    for k, ph in enumerate(hp["phases"]):
        where, wanted = f"train.phases.{k}.datasets", ph["datasets"]
        for name in wanted:
            if name not in names:
                raise EagletError(
                    f"{where}.{name}: the drafter does not read dataset '{name}' "
                    f"(it reads {', '.join(names)})"
                )
        read = {names.index(n) for n in wanted}
        refs, cut = overlong(readers, [r for r in split_train if r[0] in read], hp | ph)
        long.append(cut)
        weights = [wanted.get(n, 0) for n in names] if isinstance(wanted, dict) else None
        if weights is not None and (name := mixture.empty(names, weights, refs)) is not None:
            raise EagletError(
                f"{where}.{name}: weight {wanted[name]} but no training sample (all held out or "
                "skipped as overlong): give it weight 0 or more samples"
            )
        if len(refs) < per_step:
            raise EagletError(
                f"train.phases.{k}: {len(refs)} training samples, fewer than one global batch "
                f"({per_step})"
            )
        phases.append(Phase(refs, weights, ph["epochs"], ph["max_length"], ph["lr_scale"]))
    return phases, long


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


def make_trainer(
    cfg: DrafterConfig,
    tensors: dict[str, Tensor],
    hp: dict,
    total: int,
    run: ttt.Run,
    init: Drafter | None = None,
    lr_scale=None,
) -> Trainer:
    """A seeded drafter with the target's embeddings and the draft vocab maps, started from
    `init`'s weights when given (warm start), AdamW, linear warmup then cosine decay (times
    `lr_scale(step)`, train.phases' lr_scale, when given)."""
    torch.manual_seed(hp["seed"])
    model = Drafter(cfg)
    model.embed_tokens.weight.copy_(tensors["embed"])
    model.d2t.copy_(tensors["d2t"])
    model.t2d.copy_(tensors["t2d"])
    warm = warm_start.start_from(model, init) if init is not None else None
    model.to(run.device)
    head = TargetHead(tensors["lm_head"], tensors["t2d"], getattr(torch, run.dtype))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trainable, lr=hp["lr"], betas=(0.9, 0.95), weight_decay=hp["weight_decay"]
    )
    warmup = max(1, math.ceil(hp["warmup_ratio"] * total))
    scale = lr_scale or (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup, total, hp["min_lr_ratio"]) * scale(s)
    )
    # gradients as views into the all-reduce buckets: no second copy of them
    ddp = DDP(model, gradient_as_bucket_view=True) if run.world > 1 else model
    return Trainer(model, ddp, head.to(run.device), opt, sched, warm)


def resume(ckpt: Path, t: Trainer, hp: dict, run: ttt.Run) -> int:
    """Restore `t` and the RNGs from the checkpoint if there is one: the step to start at."""
    if not ckpt.exists():
        return 0
    try:
        state = torch.load(ckpt, map_location=run.device, weights_only=False)
    except Exception as e:  # a torn or damaged file: torch raises several kinds
        raise EagletError(
            f"{ckpt}: unreadable checkpoint ({type(e).__name__}); delete it to train from the start"
        ) from None
    if state["hp"] != hp or state["world"] != run.world:
        raise EagletError(f"{ckpt}: checkpoint of a different run (params or processes)")
    t.model.load_state_dict(state["model"])
    t.opt.load_state_dict(state["optimizer"])
    t.sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    t.rows, t.held_rows, t.best = state["rows"], state["heldout"], state.get("best")
    return state["step"]


def save_checkpoint(
    ckpt: Path, t: Trainer, step: int, steps: Steps, hp: dict, seen: dict | None = None
) -> None:
    """Everything a rerun needs to continue at `step` (rank 0 writes it, atomically); `seen`,
    what each dataset trained so far, goes beside it for `eaglet status`."""
    if steps.run.rank != 0:
        return
    state = {
        "hp": hp,
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


def train_step(
    t: Trainer, readers: list, refs: list, hp: dict, run: ttt.Run, step: int = 0
) -> tuple[dict, int]:
    """One optimizer step over this process's `refs` (micro-batches accumulated, gradients
    all-reduced once): its log row (without step and epoch) and the tokens trained.

    A non-finite loss or gradient norm stops the run before the optimizer step (the weights stay
    those of the last finite step): an EagletError naming step `step` (0-based, shown 1-based as
    in metrics.csv) and the samples. Both are checked after the all-reduce, so every process
    stops at the same step."""
    steps, bs = hp["ttt_length"], hp["batch_size"]
    weights = torch.tensor([hp["step_weight"] ** k for k in range(steps)])
    parts = [refs[i : i + bs] for i in range(0, len(refs), bs)]
    micro = [
        ttt.prepare(ttt.load(readers, part, hp["max_length"]), t.head, steps, run.device, part)
        for part in parts
    ]
    counts = torch.stack([torch.stack([m.sum() for m in b["masks"]]) for b in micro]).sum(0)
    counts = run.sum(counts.float()).clamp(min=1)
    ce_sum, hit_sum, tokens = torch.zeros(steps), torch.zeros(steps), 0
    bad: list = []  # this process's micro-batches whose loss is not finite
    t.model.train()
    for j, b in enumerate(micro):
        sync = j == len(micro) - 1 or run.world == 1
        with nullcontext() if sync else t.ddp.no_sync():  # all-reduce grads once per step
            ce, hits = ttt.ttt_batch(t.ddp, b, steps, t.head, run)
            # DDP averages gradients over processes; counts are global, so scale back
            loss = (weights.to(ce.device) * ce / counts.to(ce.device)).sum() * run.world
            loss.backward()
        ce = ce.detach().cpu()
        if not bool(torch.isfinite(ce).all()):
            bad.append(j)
        ce_sum, hit_sum = ce_sum + ce, hit_sum + hits.cpu()
        tokens += int(b["loss_mask"].sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(t.trainable, hp["max_grad_norm"])
    ce_sum, hit_sum = run.sum(ce_sum), run.sum(hit_sum)
    finite_loss = bool(torch.isfinite(ce_sum).all())
    if not (finite_loss and math.isfinite(float(grad_norm))):
        t.opt.zero_grad(set_to_none=True)
        what = "gradient" if finite_loss else "loss"
        raise non_finite(readers, parts, micro, bad, step, what)
    lr = t.sched.get_last_lr()[0]
    t.opt.step()
    t.sched.step()
    t.opt.zero_grad(set_to_none=True)
    step_loss, acc = ce_sum / counts.cpu(), hit_sum / counts.cpu()
    row = {"lr": lr, "loss": float((weights * step_loss).sum()), "grad_norm": float(grad_norm)}
    row.update({f"loss_{k}": float(step_loss[k]) for k in range(steps)})
    row.update({f"acc_{k}": float(acc[k]) for k in range(steps)})
    return row, int(run.sum(torch.tensor(tokens)))


def non_finite(
    readers: list,
    parts: list[list],
    micro: list[dict],
    bad: list[int],
    step: int,
    what: str,
) -> EagletError:
    """The error of a step whose loss or gradient is not finite, naming the step and samples:
    those with non-finite hidden states if any (the likely cause), else those of the micro-batches
    whose loss is not finite, else (another process's loss, or the gradient alone) the step's."""

    def name(ref) -> str:
        i, sid = ref
        dataset = getattr(readers[i], "manifest", {}).get("dataset")
        return f"{dataset}/{sid}" if dataset else str(sid)

    def shown(refs: list) -> str:
        more = f" +{len(refs) - 8} more" if len(refs) > 8 else ""
        return ", ".join(name(r) for r in refs[:8]) + more

    broken = []
    for part, b in zip(parts, micro, strict=True):
        for k, ref in enumerate(part):
            if not all(bool(torch.isfinite(b[f][k]).all()) for f in ("aux", "last")):
                broken.append(ref)
    if broken:
        return EagletError(
            f"train: non-finite {what} at step {step + 1} (sample {shown(broken)}: non-finite "
            "hidden states): nothing published; rebuild those states or leave them out"
        )
    refs = [r for j in bad for r in parts[j]] or [r for part in parts for r in part]
    return EagletError(
        f"train: non-finite {what} at step {step + 1} (sample {shown(refs)}): the run diverged; "
        "nothing published (lower train.lr or raise train.warmup_ratio?)"
    )


def fit(
    readers: list,
    cfg: DrafterConfig,
    tensors: dict[str, Tensor],
    hp: dict,
    out: Path,
    checkpoint_every: int = 100,
    device: str = "auto",
    quiet: bool = False,
    init: Drafter | None = None,
) -> dict:
    """Train a drafter on `readers` with hyperparameters `hp` and write it to `out` (a folder:
    model.safetensors, config.json, metrics.csv, heldout.csv). `tensors` holds the target's
    embed and lm_head and the vocab maps d2t, t2d; `init`, a drafter to start from. Resumes
    from `out`'s work folder."""
    run = ttt.Run(hp["dtype"], device)
    steps, long = plan_steps(readers, hp, run)
    t = make_trainer(cfg, tensors, hp, steps.total, run, init, steps.lr_scale)
    work = out.parent / f".{out.name}.work"
    ckpt = work / "checkpoint.pt"
    start = resume(ckpt, t, hp, run)

    drafter_data.expect(readers, steps.reads(start))
    beacon = None
    if run.rank == 0:  # the beacon of a run on its way, for `eaglet status`
        work.mkdir(parents=True, exist_ok=True)
        beacon = work / BEACON
    progress = Progress("train", steps.total, quiet or run.rank != 0, "step", beacon)
    progress.done = progress.base = start
    counted = steps.count(readers, hp, range(start))  # what each dataset trained, so far
    t0 = time.monotonic()
    for step in range(start, steps.total):
        epoch = steps.locate(step)[1]
        at = hp if steps.phases is None else hp | {"max_length": steps.phase(step).max_length}
        longer = step > start and at["max_length"] > steps.phase(step - 1).max_length
        if steps.phases is not None and longer:  # a phase of longer samples: the head's kept
            t.head.known.clear()  # rows of samples cut shorter are stale, computed again
        row, tokens = train_step(t, readers, steps.mine(step), at, run, step)
        steps.count(readers, hp, [step], counted)
        t.rows.append({"step": step + 1, "epoch": epoch} | row)
        progress.note(loss=row.get("loss"), epoch=epoch)
        progress.update(1, tokens=tokens)
        if steps.epoch_end(step) and steps.held and run.rank == 0:
            h = heldout(t.model, readers, steps.held, hp, t.head, run)
            t.held_rows.append(
                {"step": step + 1, "epoch": epoch}
                | {f"loss_{k}": v for k, v in enumerate(h["loss"])}
                | {f"acc_{k}": v for k, v in enumerate(h["acc"])}
            )
            if "select" in hp:
                select(t, readers, steps.held, hp, run, step, epoch)
        if (step + 1) % checkpoint_every == 0 and step + 1 < steps.total:
            save_checkpoint(ckpt, t, step + 1, steps, hp, steps.seen(counted))
    progress.close()
    elapsed = time.monotonic() - t0
    chosen = None
    if t.best is not None:  # train.select: the best epoch end's weights are the drafter
        missing, _ = t.model.load_state_dict(t.best["state"], strict=False)
        assert missing == ["embed_tokens.weight"], missing
        chosen = {k: v for k, v in t.best.items() if k != "state"} | {
            "by": hp["select"]["by"],
            "num_steps": hp["select"]["num_steps"],
            "curve": [r["offline_acceptance_length"] for r in t.held_rows],
        }

    final = None
    if steps.held and run.rank == 0:
        final = heldout(t.model, readers, steps.held, hp, t.head, run)
    last = t.rows[-1] if t.rows else None
    stats = {
        "steps": steps.total,
        "resumed_from": start,
        "processes": run.world,
        "dtype": run.dtype,
        "train_samples": len(steps.train),
        "datasets": steps.seen(counted),  # per dataset: samples, tokens, steps trained
        **({"phases": counted} if steps.phases is not None else {}),
        "heldout_samples": len(steps.held),
        "overlong": long,
        "final_loss": last["loss"] if last else None,
        "final_acc": [last[f"acc_{k}"] for k in range(hp["ttt_length"])] if last else None,
        "heldout": final,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(progress.tokens / elapsed, 1) if elapsed > 0 else None,
    }
    if t.warm is not None:
        stats["init_from"] = t.warm
    if chosen is not None:
        stats["selected"] = chosen
    if run.rank == 0:
        save_drafter(t.model, out, t.rows, t.held_rows)
        shutil.rmtree(work, ignore_errors=True)
    run.close()
    return stats


@dataclass(frozen=True)
class Setup:
    """Beside the spec: where things are and how the run is placed; changes no output byte."""

    states: drafter_data.States
    vocab: Path
    target: TargetSpec  # where the frozen embeddings and head are (its identity is in the spec)
    datasets: list[str]
    device: str  # as configured, e.g. cuda:1 (the spec holds its type)
    checkpoint_every: int
    min_supervised_share: float
    source: str  # the params file, for errors
    init_from: Path | None = None  # the drafter folder a warm start reads (its bytes: the spec)
    quiet: bool = False


def setup(
    keys: Keys, spec: Spec[TrainSpec], threads: int | None = None, quiet: bool = False
) -> Setup:
    if threads:
        torch.set_num_threads(threads)
    params, drafter = keys.params, spec.name
    d = params.drafter(drafter)
    settings = d["train"]
    return Setup(
        drafter_data.states(params, drafter),
        keys.path("vocab", drafter),
        keys.target,
        list(d["datasets"]),
        settings["device"],
        settings["checkpoint_every"],
        settings["min_supervised_share"],
        str(params.path),
        params.resolve(settings["init_from"]) if "init_from" in settings else None,
        quiet,
    )


def run(spec: Spec[TrainSpec], setup: Setup, out: Path) -> Path:
    """Train the drafter `spec` describes into the folder `out`, with its sidecar."""
    v = spec.values
    world, processes = int(os.environ.get("WORLD_SIZE", "1")), v.train["processes"]
    if world != processes:
        raise EagletError(
            f"{setup.source}: drafters.{spec.name}.train.processes is {processes} but "
            f"{world} processes run (WORLD_SIZE): the global batch, and so the checkpoint, "
            "depends on it"
        )
    if v.train.get("method") == "dflash":  # the same samples, a block drafter's training
        from eaglet.stages import train_dflash

        embed, lm_head = load_head(setup.target)
        stats = train_dflash.run(spec, setup, out, embed, lm_head, load_vocab(setup.vocab)[0])
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
        return out
    readers = drafter_data.open_readers(setup.states)
    d2t, t2d = load_vocab(setup.vocab)
    manifest = readers[0].manifest
    cfg = DrafterConfig(
        vocab_size=manifest["target"]["vocab_size"],
        draft_vocab_size=len(d2t),
        target_hidden_size=manifest["target"]["hidden_size"],
        aux_layer_ids=tuple(manifest["aux_layer_ids"]["sglang"]),
        **v.arch,  # resolved from the target's config and drafters.<d>.arch
    )
    embed, lm_head = load_head(setup.target)
    hp = v.train | {"heldout_fraction": v.heldout_fraction}
    init, init_format = None, None
    if setup.init_from is not None:
        where = f"{setup.source}: drafters.{spec.name}.train.init_from"
        if warm_digest(setup.init_from, where) != v.train["init_from"]:  # read what is keyed
            raise EagletError(f"{where}: {setup.init_from} changed since its key was computed")
        init_format, init = warm_start.read(setup.init_from, embed)
        warm_start.check(cfg, init, f"{where}: {setup.init_from}")
    if pick_device(setup.device).startswith("cuda"):  # on CPU: host memory, no check
        memory = torch.cuda.get_device_properties(0).total_memory
        longest = max([hp["max_length"]] + [ph["max_length"] for ph in hp.get("phases", [])])
        check_fits(readers, setup.datasets, cfg, hp | {"max_length": longest}, memory)
    from eaglet.stages import supervised

    try:  # an online reader's engine starts on its first sample and stops here
        share = supervised.shares(readers, setup.datasets, lm_head, t2d, hp["max_length"])
        supervised.check(share, setup.min_supervised_share, spec.name)
        tensors = {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d}
        stats = fit(
            readers,
            cfg,
            tensors,
            hp,
            out,
            setup.checkpoint_every,
            setup.device,
            setup.quiet,
            init,
        )
    finally:
        drafter_data.close_readers(readers)
    if int(os.environ.get("RANK", "0")) == 0:
        stats = {**stats, "supervised_share": share}
        if init_format is not None:
            stats["init_from"] = {"format": init_format} | stats["init_from"]
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
    return out
