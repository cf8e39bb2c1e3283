"""Claims: (1) the training step's peak memory is fixed + per-token x T; (2) at Kimi-K2.5's
draft vocab and TTT depth (32,000, 7) the per-token part stays within 1.5x of the demo's
(4,096, 3) at the same width; (3) eaglet.model.train_memory's per-token derivation against the
measurement; (4) the demo's step time, this tree against another.

Every point runs `eaglet.stages.train.kernel.fit` (what `eaglet train` runs) for one optimizer
step (batch 1, fp32) on one random sample of T tokens, in a fresh process: drafter, frozen
embeddings and target head, AdamW. Peak = the rise of the process's peak RSS (ru_maxrss) over
its RSS before fit. Per setting, least squares over T gives fixed + per_token x T, printed next to
eaglet.model.train_memory's derived per-token figure (fp32, the collated batch in the same memory).
Then the Kimi-K2.5 projection (arithmetic only). Widths other than 576 (the demo's own shape)
are Kimi's drafter scaled down: MHA, heads of 128, MLP 18432/7168 x H.

    .venv/bin/python -m benchmarks.train_memory [--widths 256 576] [--lengths 2560 5120]
        [--settings demo kimi] [--jobs 2] [--save points.json]
    .venv/bin/python -m benchmarks.train_memory --points points.json   # the tables again
    .venv/bin/python -m benchmarks.train_memory --time-against /tmp/old/src [--steps 20]

Lengths above drafter.RECOMPUTE (2,048 positions), where long samples train.
--time-against: the demo setting (width 576, 3 steps, vocab 4,096; 4 samples of 300 tokens a
step) trained --steps steps by this tree's src and by the given src folder (e.g. `git archive
HEAD src | tar -x -C /tmp/old`, then /tmp/old/src), alternately, --runs times each.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {  # name: (draft vocab, target vocab, TTT steps)
    "demo": (4096, 49152, 3),
    "kimi": (32000, 163840, 7),
}


def arch(width: int) -> dict:
    """The drafter at `width`: the demo's own shape at 576 (SmolLM2: 9 x 64 heads, 3 kv heads,
    MLP 1,536), else Kimi-K2.5's drafter scaled down (MHA, heads of 128, MLP 18432/7168 x H)."""
    if width == 576:
        return {"heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536}
    return {"heads": width // 128, "kv_heads": width // 128, "head_dim": 128,
            "intermediate": round(width * 18432 / 7168)}  # fmt: skip


class RandomReader:
    """The reader contract (eaglet.formats.hidden_store.HiddenReader) over random samples."""

    def __init__(self, n: int, tokens: int, width: int, vocab: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = [f"r{i}" for i in range(n)]
        self.manifest = {"samples": [{"id": s, "tokens": tokens} for s in self.ids]}
        self.samples = {}
        for sid in self.ids:
            mask = torch.ones(tokens, dtype=torch.bool)
            mask[: tokens // 8] = False  # a prompt
            self.samples[sid] = {
                "id": sid,
                "input_ids": torch.randint(0, vocab, (tokens,), generator=g),
                "loss_mask": mask,
                "aux": torch.randn(tokens, 3, width, generator=g),
                "last": torch.randn(tokens, width, generator=g),
            }

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, sid: str) -> dict:
        return self.samples[sid]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one(setting: str, width: int, t: int, samples: int, steps: int, threads: int) -> dict:
    """Train `steps` optimizer steps in this process; its peak memory rise and time."""
    import torch

    from eaglet.model.drafter import DrafterConfig
    from eaglet.stages.train import kernel as train_kernel
    from eaglet.stages.train.spec import TrainHyper

    torch.set_num_threads(threads)
    vd, v, ttt = SETTINGS[setting]
    a = arch(width)
    cfg = DrafterConfig(
        vocab_size=v, draft_vocab_size=vd, hidden_size=width, target_hidden_size=width,
        intermediate_size=a["intermediate"], num_attention_heads=a["heads"],
        num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"], rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=65536, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(v, width, generator=g), torch.randn(v, width, generator=g) / 8
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.randperm(v, generator=g)[:vd]] = True
    d2t = t2d.nonzero()[:, 0] - torch.arange(vd)
    batch = min(samples, 4)
    reader = RandomReader(samples, t, width, v)
    hp = {
        "ttt_length": ttt, "step_weight": 0.8, "epochs": 1000, "max_steps": steps,
        "batch_size": batch, "grad_accum": 1, "lr": 1e-4, "min_lr_ratio": 0.0,
        "warmup_ratio": 0.0, "weight_decay": 0.0, "max_grad_norm": 0.5, "dtype": "float32",
        "seed": 0, "heldout_fraction": 0.0, "max_length": t, "processes": 1, "device": "cpu",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base, t0 = rss_mib(), time.perf_counter()
        tensors = {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d}
        stats = train_kernel.fit([reader], cfg, tensors, TrainHyper.of(hp), Path(tmp) / "out",
                                 10**9, device="cpu", quiet=True)  # fmt: skip
        elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak - base, "s": elapsed, "step_s": stats["elapsed_s"] / steps}


def child(src: Path, *args) -> dict:
    cmd = [sys.executable, __file__, "--one", *map(str, args)]
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(args[-1])}
    # every buffer of 128 KiB or more mmapped and returned when freed: RSS follows live tensors.
    # glibc otherwise raises its threshold to the largest freed buffer (up to 32 MiB) and keeps
    # later ones in a heap that does not shrink (the loss chunks at 32,000: 31.98 MiB)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def fit_line(ts: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·t: (a, b)."""
    mt, my = statistics.mean(ts), statistics.mean(ys)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True))
    b /= sum((t - mt) ** 2 for t in ts)
    return my - b * mt, b


def measure(args) -> dict:
    """Every (setting, width, T) point, --jobs at a time, each in its own process."""
    from concurrent.futures import ThreadPoolExecutor

    points = [(st, w, t) for w in args.widths for st in args.settings for t in args.lengths]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda p: child(ROOT / "src", *p, 1, 1, args.threads), points)
        print(f"{'setting':<6} {'width':>5} {'T':>6} {'s':>7} {'peak MiB':>9}", flush=True)
        out = {}
        for (st, w, t), m in zip(points, runs, strict=True):
            print(f"{st:<6} {w:>5} {t:>6} {m['s']:>7.1f} {m['peak_mib']:>9.0f}", flush=True)
            out.setdefault(f"{st} {w}", {})[t] = m["peak_mib"]
    return out


def table(points: dict) -> None:
    """Fit each setting's points; print them against eaglet.model.train_memory's derivation."""
    from eaglet.model import train_memory

    fits = {}
    for name, by_t in points.items():
        ts = sorted(by_t, key=int)
        fits[name] = fit_line([int(t) for t in ts], [by_t[t] for t in ts])
    print("| width | setting (draft vocab, TTT steps) | fixed MiB | MiB per 1K tokens | vs demo "
          "| derived MiB per 1K (fp32) | measured / derived |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (fixed, per) in fits.items():
        setting, width = name.split()
        vd, v, ttt = SETTINGS[setting]
        a = arch(int(width))
        shape = train_memory.Shape(
            hidden=int(width), target_hidden=int(width), intermediate=a["intermediate"],
            heads=a["heads"], kv_heads=a["kv_heads"], head_dim=a["head_dim"], draft_vocab=vd,
            vocab=v, steps=ttt,
        )  # fmt: skip
        derived = train_memory.per_token(shape, "float32", host_batch=True) / 2**20
        ratio = per / fits.get(f"demo {width}", (0, float("nan")))[1]
        print(f"| {width} | {setting} ({vd:,}, {ttt}) | {fixed:,.0f} | {per * 1024:,.0f} | "
              f"{ratio:.2f}x | {derived * 1024:,.0f} | {per / derived:.2f} |")  # fmt: skip


def projection() -> None:
    """eaglet.model.train_memory's Kimi-K2.5 drafter per GPU (bf16 autocast, batch 1), itemised."""
    from eaglet.model import train_memory

    kimi = train_memory.Shape(7168, 7168, 18432, 64, 64, 128, 32000, 163840, 7)
    lengths = (8192, 16384, 32768)
    est = [train_memory.estimate(kimi, t) for t in lengths]
    gib = train_memory.GIB
    print(
        "\n| Kimi-K2.5 drafter, per GPU (GiB) | " + " | ".join(f"T = {t:,}" for t in lengths) + " |"
    )
    print("|---|" + "---|" * len(lengths))
    for item, v in est[0]["fixed_items"].items():
        print(f"| {item} | " + " | ".join(f"{v / gib:.2f}" for _ in lengths) + " |")
    per = est[0]["per_token"]
    print(f"| per token: {per / 2**20:.3f} MiB x T | "
          + " | ".join(f"{per * t / gib:.1f}" for t in lengths) + " |")  # fmt: skip
    print("| **peak** | " + " | ".join(f"**{e['peak'] / gib:.1f}**" for e in est) + " |")


def timing(args) -> None:
    srcs = {"this tree": ROOT / "src", "other": Path(args.time_against)}
    times: dict[str, list[float]] = {k: [] for k in srcs}
    for _ in range(args.runs):
        for name, src in srcs.items():
            times[name].append(child(src, "demo", 576, 300, 4 * args.steps, args.steps,
                                     args.threads)["step_s"])  # fmt: skip
    for name, ts in times.items():
        print(f"{name:<10} demo step: best {min(ts):.3f} s, median {statistics.median(ts):.3f} s"
              f"  ({', '.join(f'{t:.3f}' for t in ts)})")  # fmt: skip
    print(f"this tree / other, best: {min(times['this tree']) / min(times['other']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 576])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2560, 5120])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--threads", type=int, default=1, help="per process")
    ap.add_argument("--jobs", type=int, default=2, help="processes at once")
    ap.add_argument("--save", default="train_memory.json", help="the points, as JSON")
    ap.add_argument("--points", help="print the table of a saved run")
    ap.add_argument("--time-against", help="a src folder to time the demo step against")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        setting, *nums = args.one
        print(json.dumps(one(setting, *map(int, nums))))
    elif args.time_against:
        timing(args)
    else:
        if args.points:  # the table again from a saved run
            points = json.loads(Path(args.points).read_text())
        else:
            points = measure(args)
            Path(args.save).write_text(json.dumps(points, indent=1))
        table(points)
        projection()


if __name__ == "__main__":
    main()
