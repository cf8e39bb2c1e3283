"""What decides the trained drafter's bytes: the learning-rate schedule, the trainer, each
training step, the fit loop with its held-out checks and selection."""

from __future__ import annotations

import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglet.errors import EagletError
from eaglet.formats.drafter import save_drafter
from eaglet.model import ttt
from eaglet.model.drafter import Drafter, DrafterConfig
from eaglet.model.target_head import TargetHead
from eaglet.progress import BEACON, Progress
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import warm_start
from eaglet.stages.train.checkpoint import Trainer, resume, save_checkpoint
from eaglet.stages.train.data import Steps, plan_steps
from eaglet.stages.train.spec import TrainHyper


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def heldout(model: Drafter, readers, refs, hp: TrainHyper, head: TargetHead, run: ttt.Run) -> dict:
    """Mean per-step loss and top-1 accuracy on held-out samples."""
    steps = hp.ttt_length
    ce, hits, n = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    bs = hp.batch_size
    with torch.no_grad():
        for i in range(0, len(refs), bs):
            batch = ttt.load(readers, refs[i : i + bs], hp.max_length)
            b = ttt.prepare(batch, head, steps, run.device, refs[i : i + bs])
            c, h = ttt.ttt_batch(model, b, steps, head, run)
            ce, hits = ce + c.cpu(), hits + h.cpu()
            n += torch.stack([m.sum() for m in b["masks"]]).float().cpu()
    n = n.clamp(min=1)
    return {"loss": (ce / n).tolist(), "acc": (hits / n).tolist(), "positions": int(n[0])}


def offline_acceptance(
    model: Drafter, readers, refs, hp: TrainHyper, head: TargetHead, run
) -> float:
    """Offline acceptance length of `select.num_steps` chained drafts over the samples `refs`:
    1 + the mean accepted count over every answer start position."""
    steps = hp.select.num_steps
    n = ttt.accepted_counts(model, readers, refs, head, steps, run, hp.batch_size, hp.max_length)
    return float(1 + n.float().mean()) if len(n) else 1.0


def select(
    t: Trainer, readers, held: list, hp: TrainHyper, run: ttt.Run, step: int, epoch: int
) -> None:
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


def make_trainer(
    cfg: DrafterConfig,
    tensors: dict[str, Tensor],
    hp: TrainHyper,
    total: int,
    run: ttt.Run,
    init: Drafter | None = None,
    lr_scale=None,
) -> Trainer:
    """A seeded drafter with the target's embeddings and the draft vocab maps, started from
    `init`'s weights when given (warm start), AdamW, linear warmup then cosine decay (times
    `lr_scale(step)`, train.phases' lr_scale, when given)."""
    torch.manual_seed(hp.seed)
    model = Drafter(cfg)
    model.embed_tokens.weight.copy_(tensors["embed"])
    model.d2t.copy_(tensors["d2t"])
    model.t2d.copy_(tensors["t2d"])
    warm = warm_start.start_from(model, init) if init is not None else None
    model.to(run.device)
    head = TargetHead(tensors["lm_head"], tensors["t2d"], getattr(torch, run.dtype))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=hp.lr, betas=(0.9, 0.95), weight_decay=hp.weight_decay)
    warmup = max(1, math.ceil(hp.warmup_ratio * total))
    scale = lr_scale or (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup, total, hp.min_lr_ratio) * scale(s)
    )
    # gradients as views into the all-reduce buckets: no second copy of them
    ddp = DDP(model, gradient_as_bucket_view=True) if run.world > 1 else model
    return Trainer(model, ddp, head.to(run.device), opt, sched, warm)


def train_step(
    t: Trainer, readers: list, refs: list, hp: TrainHyper, run: ttt.Run, step: int = 0
) -> tuple[dict, int]:
    """One optimizer step over this process's `refs` (micro-batches accumulated, gradients
    all-reduced once): its log row (without step and epoch) and the tokens trained.

    A non-finite loss or gradient norm stops the run before the optimizer step (the weights stay
    those of the last finite step): an EagletError naming step `step` (0-based, shown 1-based as
    in metrics.csv) and the samples. Both are checked after the all-reduce, so every process
    stops at the same step."""
    steps, bs = hp.ttt_length, hp.batch_size
    weights = torch.tensor([hp.step_weight**k for k in range(steps)])
    parts = [refs[i : i + bs] for i in range(0, len(refs), bs)]
    micro = [
        ttt.prepare(ttt.load(readers, part, hp.max_length), t.head, steps, run.device, part)
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
    grad_norm = torch.nn.utils.clip_grad_norm_(t.trainable, hp.max_grad_norm)
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
    hp: TrainHyper,
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
    run = ttt.Run(hp.dtype, device)
    steps, long = plan_steps(readers, hp, run)
    t = make_trainer(cfg, tensors, hp, steps.total, run, init, steps.lr_scale)
    work = out.parent / f".{out.name}.work"
    ckpt = work / "checkpoint.pt"
    start = resume(ckpt, t, hp, run)

    hidden_read.expect(readers, steps.reads(start))
    progress = fit_progress(work, steps.total, start, quiet, run)
    counted = steps.count(readers, hp, range(start))  # what each dataset trained, so far
    t0 = time.monotonic()
    for step in range(start, steps.total):
        epoch = steps.locate(step)[1]
        at = at_step(t, hp, steps, step, start)
        row, tokens = train_step(t, readers, steps.mine(step), at, run, step)
        steps.count(readers, hp, [step], counted)
        t.rows.append({"step": step + 1, "epoch": epoch} | row)
        progress.note(loss=row.get("loss"), epoch=epoch)
        progress.update(1, tokens=tokens)
        if steps.epoch_end(step) and steps.held and run.rank == 0:
            epoch_end(t, readers, steps.held, hp, run, step, epoch)
        if (step + 1) % checkpoint_every == 0 and step + 1 < steps.total:
            save_checkpoint(ckpt, t, step + 1, steps, hp, steps.seen(counted))
    progress.close()
    elapsed = time.monotonic() - t0
    chosen = keep_best(t, hp)

    final = None
    if steps.held and run.rank == 0:
        final = heldout(t.model, readers, steps.held, hp, t.head, run)
    stats = fit_stats(t, steps, hp, run, start, counted, long, final, elapsed, progress.tokens)
    if chosen is not None:
        stats["selected"] = chosen
    if run.rank == 0:
        save_drafter(t.model, out, t.rows, t.held_rows)
        shutil.rmtree(work, ignore_errors=True)
    run.close()
    return stats


def fit_progress(work: Path, total: int, start: int, quiet: bool, run: ttt.Run) -> Progress:
    """The run's progress from step `start`; rank 0 leaves a beacon in the work folder for
    `eaglet status` while it runs."""
    beacon = None
    if run.rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        beacon = work / BEACON
    progress = Progress("train", total, quiet or run.rank != 0, "step", beacon)
    progress.done = progress.base = start
    return progress


def at_step(t: Trainer, hp: TrainHyper, steps: Steps, step: int, start: int) -> TrainHyper:
    """The hyperparameters of `step`: with train.phases, its phase's max_length. Entering a
    phase of longer samples clears the head's kept rows (those of samples cut shorter are
    stale, computed again)."""
    if steps.phases is None:
        return hp
    at = replace(hp, max_length=steps.phase(step).max_length)
    if step > start and at.max_length > steps.phase(step - 1).max_length:
        t.head.known.clear()
    return at


def epoch_end(
    t: Trainer, readers: list, held: list, hp: TrainHyper, run: ttt.Run, step: int, epoch: int
) -> None:
    """At an epoch end (rank 0): the held-out loss and accuracy per TTT step to heldout.csv's
    rows, and with train.select the offline acceptance that picks the weights."""
    h = heldout(t.model, readers, held, hp, t.head, run)
    t.held_rows.append(
        {"step": step + 1, "epoch": epoch}
        | {f"loss_{k}": v for k, v in enumerate(h["loss"])}
        | {f"acc_{k}": v for k, v in enumerate(h["acc"])}
    )
    if hp.select is not None:
        select(t, readers, held, hp, run, step, epoch)


def keep_best(t: Trainer, hp: TrainHyper) -> dict | None:
    """train.select: the best epoch end's weights become the drafter's; what was chosen (None
    without a selection)."""
    if t.best is None:
        return None
    missing, _ = t.model.load_state_dict(t.best["state"], strict=False)
    assert missing == ["embed_tokens.weight"], missing
    return {k: v for k, v in t.best.items() if k != "state"} | {
        "by": hp.select.by,
        "num_steps": hp.select.num_steps,
        "curve": [r["offline_acceptance_length"] for r in t.held_rows],
    }


def fit_stats(
    t: Trainer,
    steps: Steps,
    hp: TrainHyper,
    run: ttt.Run,
    start: int,
    counted: list[dict],
    long: dict,
    final: dict | None,
    elapsed: float,
    tokens: int,
) -> dict:
    """The sidecar's stats of a finished run."""
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
        "final_acc": [last[f"acc_{k}"] for k in range(hp.ttt_length)] if last else None,
        "heldout": final,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
    }
    if t.warm is not None:
        stats["init_from"] = t.warm
    return stats
