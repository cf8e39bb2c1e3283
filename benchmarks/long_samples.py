"""Claim: a TTT training step's peak memory grows about linearly with the sample's length.

One optimizer-step's forward + backward of the drafter (`Drafter.forward` with `--ttt` chained
steps, soft cross-entropy against a target distribution over the draft vocab, like
`ttt.scorer`) on one random sample of T tokens, at the demo's width (SmolLM2-135M: hidden
576, 9 heads x 64, 3 kv heads, MLP 1536, vocab 49,152, draft vocab 4,096), fp32 on CPU. Each
(variant, T) runs in a fresh process; its peak memory is the rise of the process's peak RSS
over its RSS before the step.

  chunked  eaglet's attention (drafter.attend): query rows in chunks of at most SCORES scores,
           recomputed in backward (activation checkpointing)
  full     the explicit score matrix: one chunk, kept for backward (what attend did before)

    .venv/bin/python -m benchmarks.long_samples [--lengths 1024 4096 16384] [--full 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEMO = {
    "vocab_size": 49152,
    "draft_vocab_size": 4096,
    "hidden_size": 576,
    "target_hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 32768,
    "aux_layer_ids": (1, 14, 26),
}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one(variant: str, t: int, ttt: int, threads: int) -> dict:
    """Measure one training step in this process."""
    import torch
    import torch.nn.functional as F

    from eaglet.model import drafter
    from eaglet.model.drafter import Drafter, DrafterConfig

    torch.set_num_threads(threads)
    if variant == "full":
        drafter.SCORES = 2**62
        drafter.checkpoint = lambda fn, *args, **kw: fn(*args)
    torch.manual_seed(0)
    model = Drafter(DrafterConfig(**DEMO))
    aux = torch.randn(1, t, 3, DEMO["hidden_size"])
    ids = torch.randint(0, DEMO["vocab_size"], (1, t))
    p = torch.softmax(torch.randn(1, t, DEMO["draft_vocab_size"]), -1)
    base, t0 = rss_mib(), time.perf_counter()
    logits = model(aux, ids, ttt)
    loss = sum(0.8**k * -(p * F.log_softmax(lk, -1)).sum() / t for k, lk in enumerate(logits))
    loss.backward()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "T": t, "step_s": round(elapsed, 2), "peak_mib": round(peak - base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--full", type=int, nargs="*", default=[1024, 4096], help="T for `full`")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.ttt, args.threads)))
        return
    runs = [("chunked", t) for t in args.lengths] + [("full", t) for t in args.full]
    print(f"{'variant':<8} {'T':>6} {'step s':>8} {'peak MiB':>9} {'MiB/1K tok':>10}")
    for variant, t in runs:
        cmd = [sys.executable, __file__, "--one", variant, str(t), "--ttt", str(args.ttt)]
        r = subprocess.run([*cmd, "--threads", str(args.threads)], capture_output=True, text=True)
        if r.returncode:
            print(f"{variant:<8} {t:>6} failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        m = json.loads(r.stdout)
        per = m["peak_mib"] / (t / 1024)
        print(f"{variant:<8} {t:>6} {m['step_s']:>8} {m['peak_mib']:>9} {per:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
