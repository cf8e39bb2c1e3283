"""Claim: on the same data, eaglet's drafter accepts at least as much as the one vLLM's own
trainer (vllm-project/speculators, EAGLE-3) makes, and trains no slower.

On a built demo (`make demo`), in one run:
  0. speculators 0.9.0 in a venv of its own (`.venv-speculators`, made here when missing:
     torch 2.13.0 CPU first, then speculators, then the CUDA torchvision/torchaudio removed);
  1. the demo drafter's training samples exported in speculators' offline format: the same
     token ids, loss masks and aux states (bit for bit), the training split first and eaglet's
     held-out split last (`--train-data-ratio` cuts there), and the same draft vocab (d2t/t2d
     .npy). speculators reads the last layer's state *before* the target's final norm and
     applies the norm itself; eaglet stores it after. Since RMSNorm(x) = w * x / rms(x), the
     exported state is last / w, whose norm is eaglet's stored state again (checked here
     against the target's true pre-norm state on a few samples);
  2. eaglet's train stage (train.fit with the demo's hyperparameters and seed), timed;
  3. speculators' trainer (`speculators train`, its model, loss and optimizer as shipped) at the
     demo's settings where its CLI has them: 1 layer, 3 TTT steps, 4 epochs, lr 1.5e-3, the
     same optimizer steps per epoch (its packing length chosen to match 4 samples a step),
     fp32, the demo's aux layers and seed; everything else its defaults (Muon, linear decay,
     KL, equal step weights, EAGLE-3.1 norms). benchmarks/peer_speculators_shim.py is the
     launcher-side CPU shim (device plumbing only, listed there), timed the same way;
  4. stock vLLM serving the target with each drafter (eaglet's vLLM export, speculators' last
     epoch folder) on the demo's natural held-out prompts (its evaluate settings: 16 prompts,
     96 new tokens, 3 steps, greedy): acceptance length from vLLM's /metrics counters, as the
     demo's evaluate stage reads it (eaglet.stages.evaluate.engine), and each output against the
     plain greedy text of the same engine.

    .venv/bin/python -m benchmarks.peer_speculators [--params params.yaml] [--drafter demo]
        [--work DIR] [--threads 2] [--speculators-arg=--optimizer=adamw ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.common import export_eaglet, fit_args, serve_all, train_eaglet
from eaglet.model import capture
from eaglet.model.target import load_config, load_tensor, materialize, spec_of
from eaglet.params import load
from eaglet.stages.hidden import read as hidden_read

ROOT = Path(__file__).resolve().parents[1]

VENV = ROOT / ".venv-speculators"
SHIM = ROOT / "benchmarks" / "peer_speculators_shim.py"
SPECULATORS = "speculators==0.9.0"
PINS = ("torch==2.13.0", "transformers==5.19.0")  # the CPU torch wheel; speculators' cap
# MUON: speculators' default optimizer is torch.optim.Muon, whose Newton-Schulz iterations run in
# bfloat16: on this CPU (no AMX) one Muon step of the fc matrix alone took 30 s and a whole step
# 126-141 s (AdamW: 1.4-2.0 s), so a 408-step run would take about 15 hours. The comparison uses
# its AdamW option (eaglet's optimizer too); --speculators-arg=--optimizer=muon restores it.


def speculators_python() -> Path:
    """speculators' venv, made once: torch (the local CPU wheel) before anything can pull a
    CUDA build, then speculators by uv; torchvision/torchaudio (CUDA wheels) removed, as the
    Makefile does for vLLM."""
    py = VENV / "bin" / "python"
    if (VENV / ".installed").exists():
        return py

    def run(*cmd: str, **kw) -> None:
        subprocess.run(cmd, check=True, **kw)

    run(sys.executable, "-m", "venv", str(VENV))
    run(str(py), "-m", "pip", "install", "-q", "uv", PINS[0])
    env = {**os.environ, "VIRTUAL_ENV": str(VENV)}
    run(str(VENV / "bin" / "uv"), "pip", "install", "-q", SPECULATORS, *PINS, env=env)
    run(str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
    (VENV / ".installed").touch()
    return py


def export_samples(readers: list, refs: list, norm_w: torch.Tensor, d2t, t2d, out: Path) -> None:
    """The samples `refs` in speculators' offline layout under `out` (rows.jsonl for the Arrow
    dataset, hidden_states/hs_{i}.safetensors [T, 4, H] fp32), and d2t/t2d as .npy."""
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    with open(out / "rows.jsonl", "w") as rows:
        for i, (r, sid) in enumerate(refs):
            s = readers[r].get(sid)
            prenorm = s["last"].float() / norm_w  # RMSNorm(last / w) == last (see the docstring)
            hs = torch.cat([s["aux"].float(), prenorm[:, None]], dim=1).contiguous()
            save_file(
                {"hidden_states": hs, "token_ids": s["input_ids"].long().contiguous()},
                str(out / "hidden_states" / f"hs_{i}.safetensors"),
            )
            mask = s["loss_mask"].long().tolist()
            rows.write(json.dumps({"input_ids": s["input_ids"].tolist(), "loss_mask": mask}) + "\n")
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())


def check_prenorm(spec, readers: list, refs: list, norm_w, eps: float, n: int = 2) -> dict:
    """How far the exported pre-norm state is from the target's own, on n samples: the target's
    last decoder-layer output (fp32 forward here) normed, against eaglet's stored state, and
    against the norm of the exported state; both as max relative L2 error per token."""
    from eaglet.model.target import load_model

    model = load_model(spec, "cpu", "float32")
    got: dict = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: got.__setitem__("x", o[0] if isinstance(o, tuple) else o)
    )
    worst_stored, worst_export = 0.0, 0.0
    try:
        for r, sid in refs[:n]:
            s = readers[r].get(sid)
            with torch.no_grad():
                model(s["input_ids"][None])
            true = capture.rms_norm(got["x"][0], norm_w, eps)
            ours = capture.rms_norm(s["last"].float() / norm_w, norm_w, eps)

            def rel(a, b):
                return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

            worst_stored = max(worst_stored, rel(s["last"].float(), true))
            worst_export = max(worst_export, rel(ours, true))
    finally:
        hook.remove()
    return {"samples": n, "stored_vs_target": worst_stored, "exported_vs_target": worst_export}


def train_speculators(
    py: Path,
    data: Path,
    save: Path,
    steps: int,
    hp: dict,
    extra: list[str],
    verifier: str,
    layers: list[int],
    threads: int,
) -> dict:
    """speculators' trainer through the shim, in its own process; wall time around it."""
    argv = [
        "--verifier-name-or-path", verifier,
        "--data-path", str(data),
        "--save-path", str(save),
        "--log-dir", str(save / "logs"),
        "--speculator-type", "eagle3",
        "--num-layers", "1",
        "--draft-arch", "llama",
        "--target-layer-ids", *map(str, layers),
        "--d2t-path", str(data / "d2t.npy"),
        "--t2d-path", str(data / "t2d.npy"),
        "--ttt-steps", str(hp["ttt_length"]),
        "--epochs", str(hp["epochs"]),
        "--lr", str(hp["lr"]),
        "--seed", str(hp["seed"]),
        "--train-data-ratio", str(hp["train_ratio"]),
        "--hidden-states-dtype", "float32",
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--num-workers", "0",
        "--on-missing", "raise",
        "--no-resume-from-checkpoint",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    log = save.parent / f"{save.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(
            [str(py), str(SHIM), "train", str(steps), "--", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        ).returncode
    seconds = time.perf_counter() - t0
    text = log.read_text()
    if rc:
        tail = "\n".join(text.splitlines()[-25:])
        raise SystemExit(f"speculators train failed (exit {rc}), {log}:\n{tail}")
    lines = [json.loads(x) for x in text.splitlines() if x.startswith('{"')]
    info = {k: v for line in lines for k, v in line.items()}
    last = max((p for p in save.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return {"seconds": seconds, "checkpoint": last, "log": log, **info}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="a built demo")
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--work", help="keep the exported data and both drafters here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--speculators-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="an extra `speculators train` flag (e.g. --optimizer=adamw)",
    )
    ap.add_argument(
        "--max-steps", type=int, help="stop both trainers after this many optimizer steps"
    )
    ap.add_argument(
        "--eaglet-variant",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="also train eaglet with these hyperparameters changed (e.g. seed=43), served beside",
    )
    ap.add_argument(
        "--variants-only",
        action="store_true",
        help="train and serve only the eaglet variants (vLLM's greedy numbers are deterministic: "
        "compare with an earlier full run's)",
    )
    ap.add_argument("--no-serve", action="store_true", help="train only")
    ap.add_argument(
        "--no-greedy-check", action="store_true", help="skip the plain greedy reference run"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    py = None if args.variants_only else speculators_python()  # variants: eaglet only
    params = load(args.params)
    spec = spec_of(params)
    readers = hidden_read.open_readers(hidden_read.states(params, args.drafter))
    a = fit_args(params, args.drafter, readers)
    hp = a.pop("hp")
    train_refs, held_refs = hidden_read.split(readers, hp["heldout_fraction"])
    norm_w = load_tensor(spec, "model.norm.weight").float()
    eps = float(load_config(spec).rms_norm_eps)
    verifier = materialize(spec)
    work = Path(args.work or tempfile.mkdtemp(prefix="peer-speculators-"))
    data = work / "data"
    if py and not (data / "dataset_info.json").exists():
        export_samples(
            readers, train_refs + held_refs, norm_w, a["tensors"]["d2t"], a["tensors"]["t2d"], data
        )
        subprocess.run([str(py), str(SHIM), "prepare", str(data)], check=True)
    check = check_prenorm(spec, readers, train_refs, norm_w, eps)
    print(f"# pre-norm state exported: {json.dumps(check)}", flush=True)
    n = len(train_refs) + len(held_refs)
    per_epoch = len(train_refs) // (hp["batch_size"] * hp["grad_accum"])
    extra = ["--optimizer", "adamw", *args.speculators_arg]  # Muon: see MUON below
    if args.max_steps:  # both: the schedule decays over the steps run, whole epochs begun
        hp |= {"max_steps": args.max_steps, "epochs": -(-args.max_steps // per_epoch)}
        extra += ["--max-steps", str(args.max_steps)]

    arch = load_config(spec).architectures
    verifier_cfg = {"name_or_path": verifier, "architectures": arch}
    runs, exports = {}, {}
    for variant in args.eaglet_variant:
        change = dict(kv.split("=", 1) for kv in variant.split(","))
        over = {k: type(hp[k])(v) if hp.get(k) is not None else float(v) for k, v in change.items()}
        name = f"eaglet {variant}"
        runs[name] = train_eaglet(a, hp | over, work / f"eaglet-{variant}")
        print(f"# {name} trained in {runs[name]['seconds']:.1f} s", flush=True)
        exports[name] = export_eaglet(runs[name]["model"], verifier_cfg, work / f"eaglet-{variant}")
    if not args.variants_only:
        ours = train_eaglet(a, hp, work / "eaglet")
        print(f"# eaglet trained in {ours['seconds']:.1f} s", flush=True)
        theirs = train_speculators(
            py,
            data,
            work / "speculators",
            per_epoch,
            hp | {"train_ratio": (len(train_refs) + 0.5) / n},
            extra,
            verifier,
            [i + 1 for i in a["cfg"].aux_layer_ids],
            args.threads,
        )
        print(f"# speculators trained in {theirs['seconds']:.1f} s ({theirs})", flush=True)
        runs = {"eaglet": ours, "speculators": theirs, **runs}
        exports = {
            "eaglet": export_eaglet(ours["model"], verifier_cfg, work / "eaglet"),
            "speculators": theirs["checkpoint"],
            **exports,
        }
    served = (
        None
        if args.no_serve
        else serve_all(params, args.drafter, exports, args.threads, not args.no_greedy_check)
    )
    report(runs, hp, served, len(train_refs), per_epoch)


def report(runs: dict, hp: dict, served: dict | None, n: int, per_epoch: int):
    print(f"\n# {n} training samples, {per_epoch} optimizer steps an epoch, both trainers")
    if "speculators" in runs:
        theirs = runs["speculators"]
        print(
            f"# speculators: --total-seq-len {theirs.get('total_seq_len')} (packed), "
            f"run_training {theirs.get('run_training_s')} s of {theirs['seconds']:.1f} s"
        )
    print("\n| trainer | wall time | epochs | acceptance length at 3 steps | per position |")
    print("|---|---|---|---|---|")
    for name, run in runs.items():
        m = (served or {}).get(name)
        al = f"{m['acceptance_length']:.3f}" if m else "not served"
        rates = ", ".join(f"{x:.2f}" for x in m["acceptance_rate"]) if m else ""
        if m:
            same = "" if "greedy_equal" not in m else f", greedy equal {m['greedy_equal']}"
            al += f" ({m['drafts']} drafts{same})"
        print(f"| {name} | {run['seconds']:.1f} s | {hp['epochs']} | {al} | {rates} |")


if __name__ == "__main__":
    main()
