"""Claim: hidden states from one vLLM engine (extract_hidden_states, a binary file per request)
keep up with the in-process transformers stage, and the JSON route SGLang offers would cost more
CPU per token at Kimi-K2.5's width than a GPU node spends computing the states.

Side by side in one run, on the embedded target (SmolLM2, H=576) and the natural-text sequences
of benchmarks/hidden_states.py:
  1. the hidden stage with `backend: transformers` and with `backend: vllm` (same storage),
     tokens/s without the one-off load (model load / engine start, reported apart) and bytes/token;
  2. at H = 7,168 (Kimi-K2.5), per token: JSON encode + decode of the 4 x H floats SGLang returns
     (`.tolist()` then json), against a safetensors write + read of the same states in bf16.

    .venv/bin/python -m benchmarks.hidden_engine [--samples 16] [--tokens 256] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import pressure, project, stage, with_hidden

KIMI_HIDDEN = 7168
STATES = 4  # 3 aux layers + the final state


def stage_rate(params_file: Path, out: Path, runs: int) -> dict:
    best = None
    for _ in range(runs):
        st = stage(params_file, out)
        if best is None or st["run_s"] < best["run_s"]:
            best = st
    assert best is not None
    return best


def json_cost(tokens: int = 16) -> dict:
    """Seconds per token to move 4 x 7,168 states as JSON (encode + decode) and as a binary
    file, and the bytes each takes."""
    x = torch.randn(tokens, STATES * KIMI_HIDDEN)
    t0 = time.perf_counter()
    text = json.dumps({"hidden_states": x.tolist()})
    t1 = time.perf_counter()
    back = torch.tensor(json.loads(text)["hidden_states"])
    t2 = time.perf_counter()
    assert back.shape == x.shape
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.safetensors")
        t3 = time.perf_counter()
        save_file({"hidden_states": x.to(torch.bfloat16)}, path)
        load_file(path)
        t4 = time.perf_counter()
        size = os.path.getsize(path)
    return {
        "json_encode_s": (t1 - t0) / tokens,
        "json_decode_s": (t2 - t1) / tokens,
        "json_bytes": len(text) / tokens,
        "binary_s": (t4 - t3) / tokens,
        "binary_bytes": size / tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256, help="response tokens per sample")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    args.compute_dtype = "float32"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = project(tmp, args)
        rows = {
            "transformers": stage_rate(base, tmp / "hf", args.runs),
            "vllm": stage_rate(with_hidden(base, backend="vllm"), tmp / "vllm", args.runs),
        }
    tokens = rows["transformers"]["tokens"]
    print(
        f"SmolLM2 fp32, {args.threads} threads, {args.samples} sequences, {tokens} tokens; "
        f"{pressure()}"
    )
    print(f"{'hidden backend':<14} {'tok/s':>8} {'load s':>8} {'B/token':>9}")
    for name, st in rows.items():
        rate = st["tokens"] / st["run_s"]
        print(f"{name:<14} {rate:8.0f} {st['load_s']:8.1f} {st['bytes_per_token']:9.1f}")
    ratio = rows["transformers"]["run_s"] / rows["vllm"]["run_s"]
    print(f"vllm / transformers throughput: {ratio:.2f}x")
    c = json_cost()
    per_token = c["json_encode_s"] + c["json_decode_s"]
    print(f"at H = {KIMI_HIDDEN}, {STATES} states a token:")
    print(
        f"  JSON   encode {1e3 * c['json_encode_s']:.2f} ms + decode "
        f"{1e3 * c['json_decode_s']:.2f} ms a token = {1 / per_token:,.0f} tok/s a core; "
        f"{c['json_bytes'] / 1e3:,.0f} KB a token"
    )
    print(
        f"  binary write + read {1e3 * c['binary_s']:.3f} ms a token = "
        f"{1 / c['binary_s']:,.0f} tok/s a core; {c['binary_bytes'] / 1e3:,.1f} KB a token"
    )


if __name__ == "__main__":
    sys.exit(main())
