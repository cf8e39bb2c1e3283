"""The train stage's run: the states opened, the fit checked against memory, the drafter
built or warm-started, trained (DDP under torchrun) and saved with its sidecar."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eaglet.errors import EagletError
from eaglet.formats.io import write_json
from eaglet.formats.vocab import load_vocab
from eaglet.graph.keys import Keys, Spec, sidecar_of
from eaglet.model import train_memory
from eaglet.model.drafter import Drafter, DrafterConfig
from eaglet.model.target import TargetSpec, load_head, pick_device
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import warm_start
from eaglet.stages.train.kernel import fit
from eaglet.stages.train.spec import TrainHyper, TrainSpec, warm_digest


def check_fits(
    readers: list, names: list[str], cfg: DrafterConfig, hp: TrainHyper, memory: int
) -> None:
    """Before training on a GPU of `memory` bytes: a one-line error naming the dataset and the
    length when its longest sample (as trained: cut at max_length, or skipped) would not fit,
    by eaglet.model.train_memory's estimate."""
    shape = train_memory.Shape.of(
        cfg.to_dict(), cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size, hp.ttt_length
    )
    bs, gib = hp.batch_size, train_memory.GIB
    most = train_memory.longest(shape, memory, hp.dtype) // bs
    for name, r in zip(names, readers, strict=True):
        lengths = [s["tokens"] for s in r.manifest["samples"]]
        if hp.policy == "skip":
            lengths = [n for n in lengths if n <= hp.max_length]
        t = min(max(lengths, default=0), hp.max_length)
        if t > most:
            peak = train_memory.estimate(shape, bs * t, hp.dtype)["peak"]
            raise EagletError(
                f"dataset {name}: a sample of {t:,} tokens (batch {bs}) needs about "
                f"{peak / gib:.1f} GiB per GPU to train, this GPU has {memory / gib:.1f} GiB; "
                f"the longest that fits is {most:,} tokens: lower train.max_length "
                "(train.overlong: truncate or skip)"
            )


@dataclass(frozen=True)
class Setup:
    """Beside the spec: where things are and how the run is placed; changes no output byte."""

    states: hidden_read.States
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
        hidden_read.states(params, drafter),
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
    hp = spec.values.hyper
    check_processes(hp, setup, spec.name)
    if hp.method == "dflash":  # the same samples, a block drafter's training
        from eaglet.stages.train import dflash as train_dflash

        embed, lm_head = load_head(setup.target)
        stats = train_dflash.run(spec, setup, out, embed, lm_head, load_vocab(setup.vocab)[0])
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
        return out
    readers = hidden_read.open_readers(setup.states)
    d2t, t2d = load_vocab(setup.vocab)
    cfg = drafter_config(readers[0].manifest, len(d2t), spec.values.arch)
    embed, lm_head = load_head(setup.target)
    init_format, init = warm(setup, spec, cfg, embed)
    if pick_device(setup.device).startswith("cuda"):  # on CPU: host memory, no check
        memory = torch.cuda.get_device_properties(0).total_memory
        longest = max([hp.max_length] + [ph.max_length for ph in hp.phases or ()])
        check_fits(readers, setup.datasets, cfg, replace(hp, max_length=longest), memory)
    from eaglet.stages.train import supervised

    try:  # an online reader's engine starts on its first sample and stops here
        share = supervised.shares(readers, setup.datasets, lm_head, t2d, hp.max_length)
        supervised.check(share, setup.min_supervised_share, spec.name)
        tensors = {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d}
        every, device, quiet = setup.checkpoint_every, setup.device, setup.quiet
        stats = fit(readers, cfg, tensors, hp, out, every, device, quiet, init)
    finally:
        hidden_read.close_readers(readers)
    if int(os.environ.get("RANK", "0")) == 0:
        stats = {**stats, "supervised_share": share}
        if init_format is not None:
            stats["init_from"] = {"format": init_format} | stats["init_from"]
        write_json(sidecar_of(out), {"provenance": spec.provenance(), "stats": stats})
    return out


def check_processes(hp: TrainHyper, setup: Setup, drafter: str) -> None:
    """The processes torchrun started are the ones the key counts (the global batch)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != hp.processes:
        raise EagletError(
            f"{setup.source}: drafters.{drafter}.train.processes is {hp.processes} but "
            f"{world} processes run (WORLD_SIZE): the global batch, and so the checkpoint, "
            "depends on it"
        )


def drafter_config(manifest: dict, draft_vocab: int, resolved: dict) -> DrafterConfig:
    """The drafter's shape: the stored target's sizes and aux layers, the draft vocab, and the
    layer `resolved` from the target's config and drafters.<d>.arch."""
    return DrafterConfig(
        vocab_size=manifest["target"]["vocab_size"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=manifest["target"]["hidden_size"],
        aux_layer_ids=tuple(manifest["aux_layer_ids"]["sglang"]),
        **resolved,
    )


def warm(
    setup: Setup, spec: Spec[TrainSpec], cfg: DrafterConfig, embed: torch.Tensor
) -> tuple[str | None, Drafter | None]:
    """(format, drafter) of the warm start train.init_from names, checked against the bytes its
    key holds and this run's shape; (None, None) without one."""
    if setup.init_from is None:
        return None, None
    where = f"{setup.source}: drafters.{spec.name}.train.init_from"
    if warm_digest(setup.init_from, where) != spec.values.hyper.init_from:  # read what is keyed
        raise EagletError(f"{where}: {setup.init_from} changed since its key was computed")
    init_format, init = warm_start.read(setup.init_from, embed)
    warm_start.check(cfg, init, f"{where}: {setup.init_from}")
    return init_format, init
