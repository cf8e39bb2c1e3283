# Shared set-up: params validated on load, keys and keyed paths from eaglet itself.
import os
import re
import sys

from snakemake.utils import min_version

from eaglet.device import resolve_device
from eaglet.errors import AwaitedFile, EagletError
from eaglet.graph.keys import STAGES, Keys
from eaglet.params import load, run_here

min_version("9.0")

PARAMS_FILE = config.get("params", "params.yaml")
try:
    PARAMS = run_here(load(PARAMS_FILE), os.getcwd())
    KEYS = Keys(PARAMS)
except EagletError as e:
    sys.exit(f"eaglet: error: {e}")
DATASETS = PARAMS.datasets
DATASET_STAGES = [s.name for s in STAGES.values() if s.kind == "dataset"]
DRAFTER_STAGES = [s.name for s in STAGES.values() if s.kind == "drafter"]
EAGLET = f"{sys.executable} -m eaglet"


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in DATASETS),
    drafter="|".join(re.escape(d) for d in PARAMS.drafters) or "^$",
    fmt="sglang|vllm",
    key="[0-9a-f]{12}",


def keyed(stage, name=None):
    """The current keyed path of an artifact, relative to the working directory."""
    try:
        path = KEYS.path(stage, name)
    except EagletError as e:
        sys.exit(f"eaglet: error: {e}")
    return os.path.relpath(path)


def wanted():
    """Every artifact params define, at its current key; an evaluation whose held-out suite is
    not there yet is left out with a warning, so everything before it builds."""
    out = [keyed(stage, ds) for ds in DATASETS for stage in DATASET_STAGES]
    for d in PARAMS.drafters:
        for stage in DRAFTER_STAGES:
            try:
                out.append(os.path.relpath(KEYS.path(stage, d)))
            except AwaitedFile as e:
                print(f"eaglet: {stage} {d} left out: {e}", file=sys.stderr)
            except EagletError as e:
                sys.exit(f"eaglet: error: {e}")
    return out


def upstream(stage):
    """Input function: the dataset's current `stage` artifact. Keyed, so never stale by mtime."""
    return lambda wc: ancient(keyed(stage, wc.dataset))


def drafter_upstream(*stages):
    """Input function: a drafter's current `stages` artifacts, plus the hidden states of its
    datasets. Keyed, so never stale by mtime."""

    def inputs(wc):
        hidden = [keyed("hidden", ds) for ds in PARAMS.drafter(wc.drafter)["datasets"]]
        return [ancient(p) for p in [keyed(s, wc.drafter) for s in stages] + hidden]

    return inputs


def launcher(processes):
    """The command that starts eaglet: plain, or torchrun with `processes` DDP processes on
    this node (one per GPU); the rule's `gpu` resource asks the scheduler for as many."""
    if processes == 1:
        return EAGLET
    run = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node {processes}"
    return f"{run} -m eaglet"


def placement(drafter, stage):
    """(device, processes) of a drafter stage's settings."""
    settings = PARAMS.drafter(drafter)[stage]
    return settings["device"], settings.get("processes", 1)


def gpus(device, processes=1):
    """The `gpu` resource of a rule running `processes` processes on `device` (`auto` resolved
    here as the keys resolve it: on a cluster, set the device explicitly)."""
    return processes if resolve_device(device).startswith("cuda") else 0


def engine_evaluates(drafter):
    """Whether the drafter's evaluation serves its vLLM export in a vLLM engine too."""
    return PARAMS.drafter(drafter)["evaluate"]["engine"] != "none"


def evaluate_gpus(drafter):
    """The evaluate rule's `gpu` resource: the engine eaglet starts (tensor parallel), else one
    for the in-process decoder; none for an operator's engine alone."""
    cfg = PARAMS.drafter(drafter)["evaluate"]
    in_process = KEYS.provenance("evaluate", drafter)["params"]["evaluate"]["in_process"]
    engine = cfg["engine_tensor_parallel_size"] if cfg["engine"] != "none" else 0
    engine = 0 if "engine_url" in cfg else engine
    return gpus(cfg["device"], max(engine, int(in_process)))


def remote_backend(dataset):
    """Whether the dataset's backend is a remote server (sglang, openai, vllm at a `url`) rather
    than computing here (in-process transformers, or a vLLM server eaglet starts)."""
    cfg = PARAMS.backend(PARAMS.generation(dataset)["backend"])
    return cfg["kind"] not in ("transformers", "vllm") or "url" in cfg
