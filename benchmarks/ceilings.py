"""Claim: how close each heavy stage of the demo runs to what this machine can do.

For the demo's target (SmolLM2-135M, fp32), side by side in one run, each stage's rate next to
a ceiling measured on the same machine a moment before:
  0. GEMM: fp32 and bf16 matmul throughput at the target's decode shapes (M = --batch), the
     compute-bound limit: tokens/s = GFLOP/s / (2 x parameters) per token;
  1. generation: a bare greedy decode loop (the target's forward with a KV cache, --batch rows,
     every row decoding --steps tokens: no stopping, no scheduling, no server) against the
     responses stage with the demo's backend on --prompts of the demo's instructions
     (completion tokens/s, with and without its engine's start-up);
  2. hidden states: the target's bare trunk over the stage's length batches against the hidden
     stage (the setup of benchmarks/hidden_states.py);
  3. training: the drafter's bare training step (TTT forward, loss, backward, AdamW on tensors
     already in memory) against `train_kernel.fit` on the demo's stored hidden states (positions/s;
     needs `make demo` first, else skipped).
Threads: --threads (the demo's jobs use 2). CPU pressure is shown next to the numbers.

    .venv/bin/python -m benchmarks.ceilings [--batch 128] [--prompts 256] [--train-steps 12]
        [--params BUILT_DEMO/params.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import bare, fit_args, pressure, project, stage
from eaglet.engines.vllm.generate import serve_config
from eaglet.engines.vllm.server import Engine
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.hidden_store import HiddenReader
from eaglet.formats.io import read_json, read_jsonl
from eaglet.graph.keys import build, sidecar_of
from eaglet.model.drafter import Drafter
from eaglet.model.target import load_model, load_tokenizer, spec_of
from eaglet.params import load
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.train.spec import TrainHyper

ROOT = Path(__file__).resolve().parents[1]


def best(fn, runs: int) -> float:
    """The shortest of `runs` timings of fn() in seconds."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm(model, batch: int) -> dict:
    """GFLOP/s of the target's decode matmuls (every Linear of one layer, plus lm_head) at M=batch,
    per dtype, and the tokens/s they allow for the whole model."""
    n_params = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    shapes = [m.weight.shape for m in model.model.layers[0].modules() if hasattr(m, "weight")]
    shapes = [s for s in shapes if len(s) == 2] + [model.lm_head.weight.shape]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(s, dtype=dtype) for s in shapes]
        xs = [torch.randn(batch, s[1], dtype=dtype) for s in shapes]
        flops = sum(2 * batch * s[0] * s[1] for s in shapes)
        sec = best(lambda xs=xs, ws=ws: [x @ w.T for x, w in zip(xs, ws, strict=True)], 5)
        gflops = flops / sec / 1e9
        out[str(dtype).removeprefix("torch.")] = {
            "gflop_s": round(gflops, 1),
            "tokens_s_bound": round(gflops * 1e9 / (2 * n_params), 1),
        }
    return out


def decode_loop(model, rows: list[list[int]], steps: int) -> float:
    """Completion tokens/s of a bare greedy loop: left-padded rows, `steps` tokens each."""
    from transformers import DynamicCache

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1)
        for _ in range(steps - 1):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache)
    return len(rows) * steps / (time.perf_counter() - t0)


def generation(args, model, tokenizer) -> dict:
    """The bare loop, then the responses stage with the demo's backend on the same prompts."""
    demo = yaml.safe_load((ROOT / "params.yaml").read_text())
    source = ROOT / "data" / "demo" / "instructions.jsonl"
    rows = [[{"role": "user", "content": r["instruction"]}] for r in read_jsonl(source)]
    rows = [prompt_ids(tokenizer, m) for m in rows[: args.prompts]]
    ceiling = decode_loop(model, rows[: args.batch], args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        data = {k: demo[k] for k in ("target", "backends", "generation")}
        data["datasets"] = {"x": {"path": str(source), "format": "alpaca"}}
        data["prompts"] = {"seed": 0}
        data["datasets"]["x"] |= {"max_samples": args.prompts, "max_new_tokens": args.steps}
        (Path(tmp) / "params.yaml").write_text(yaml.safe_dump(data))
        params = load(Path(tmp) / "params.yaml")
        log = Path(tmp) / "engine.log"
        with Engine(serve_config_of(params), log=log) as engine:  # its start-up, alone
            startup = engine.startup_s
        build("prompts", params, "x")
        out = build("responses", params, "x", threads=args.threads, quiet=True)
        elapsed = read_json(sidecar_of(out))["stats"]["elapsed_s"]
        tokens = sum(r["completion_tokens"] or 0 for r in read_jsonl(out))
    return {
        "backend": params.backend(params.generation("x")["backend"])["kind"],
        "bare_loop_tokens_s": round(ceiling, 1),
        "stage_tokens_s": round(tokens / elapsed, 1),
        "stage_tokens_s_without_startup": round(tokens / (elapsed - startup), 1),
        "engine_startup_s": startup,
        "completion_tokens": tokens,
    }


def serve_config_of(params):
    """The server the demo's generation backend starts."""
    cfg = params.backend(params.generation("x")["backend"])
    return serve_config(spec_of(params), cfg, params.target["max_length"], None)


def hidden(args, model) -> dict:
    """The bare trunk over the sequences the hidden stage stored, then the stage (no load)."""
    with tempfile.TemporaryDirectory() as tmp:
        ns = argparse.Namespace(samples=32, tokens=256, threads=args.threads, compute_dtype="auto")
        params_file = project(Path(tmp), ns)
        out = Path(tmp) / "states"
        stage(params_file, out)  # warm-up, and the sequences the bare loop replays
        seqs = [s["input_ids"].tolist() for s in HiddenReader(out)]
        batch_tokens = load(params_file).data["hidden"]["batch_tokens"]
        ceiling = sum(map(len, seqs)) / bare(model, seqs, batch_tokens)
        st = stage(params_file, out)
    return {
        "bare_trunk_tokens_s": round(ceiling, 1),
        "stage_tokens_s": round(st["tokens"] / (st["elapsed_s"] - st["load_s"]), 1),
    }


def training(args) -> dict | None:
    params = load(args.params)
    try:
        readers = hidden_read.open_readers(hidden_read.states(params, "demo"))
    except EagletError as e:  # not built yet
        print(f"# training skipped: the demo's hidden states are not built ({e})")
        return None
    a = fit_args(params, "demo", readers)
    hp, cfg = a.pop("hp"), a["cfg"]
    refs, _ = hidden_read.split(readers, hp["heldout_fraction"])
    with tempfile.TemporaryDirectory() as tmp:
        st = train_kernel.fit(
            **a,
            hp=TrainHyper.of(hp | {"max_steps": args.train_steps}),
            out=Path(tmp) / "d",
            checkpoint_every=10**9,
            quiet=True,
        )
    batch, width = hp["batch_size"], mean_length(readers, refs)
    stage_pos_s = st["tokens_per_s"] / assistant_share(readers, refs)
    model = Drafter(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    aux = torch.randn(batch, width, 3, cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (batch, width))
    target = torch.randint(0, cfg.draft_vocab_size, (batch, width))
    steps = hp["ttt_length"]

    def step():
        logits = model(aux, ids, steps)
        flat = target.flatten()
        loss = sum(torch.nn.functional.cross_entropy(lk.flatten(0, 1), flat) for lk in logits)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    sec = best(step, 5)
    return {
        "bare_step_positions_s": round(batch * width / sec, 1),
        "stage_positions_s": round(stage_pos_s, 1),
        "stage_assistant_tokens_s": st["tokens_per_s"],
        "batch": batch,
        "mean_positions": width,
    }


def mean_length(readers, refs) -> int:
    return round(statistics.mean(len(readers[i].get(s)["input_ids"]) for i, s in refs[:256]))


def assistant_share(readers, refs) -> float:
    """Assistant tokens per position over the training samples (the stage reports the former)."""
    a = n = 0
    for i, s in refs[:256]:
        x = readers[i].get(s)
        a, n = a + int(x["loss_mask"].sum()), n + len(x["input_ids"])
    return a / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps of the bare loop")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="a built demo (training)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load(ROOT / "params.yaml")
    spec = spec_of(params)
    model = load_model(spec, "cpu", "float32")
    tokenizer = load_tokenizer(spec)
    print(f"# cpu pressure before: {pressure()}", flush=True)
    report = {"gemm": gemm(model, args.batch)}
    print(json.dumps(report["gemm"]), flush=True)
    report["generation"] = generation(args, model, tokenizer)
    print(json.dumps(report["generation"]), flush=True)
    report["hidden"] = hidden(args, model)
    print(json.dumps(report["hidden"]), flush=True)
    report["train"] = training(args)
    print(f"# cpu pressure after: {pressure()}")
    rows = [
        ("generation", report["generation"]["stage_tokens_s"], "bare_loop_tokens_s"),
        ("hidden", report["hidden"]["stage_tokens_s"], "bare_trunk_tokens_s"),
    ]
    if report["train"]:
        rows.append(("train", report["train"]["stage_positions_s"], "bare_step_positions_s"))
    print("\n| stage | stage rate | ceiling | stage / ceiling |\n|---|---|---|---|")
    for name, rate, key in rows:
        ceiling = report[name][key]
        print(f"| {name} | {rate:,.0f} | {ceiling:,.0f} ({key}) | {rate / ceiling:.2f} |")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
