"""Claim: eaglet's generation client keeps a remote backend busy, in flat memory.

Against a loopback server (tests/fake_llm.py, its own process) that answers every chat request
after a fixed latency, measured side by side in one run:
  1. achieved requests/s of `eaglet generate` as a ratio of the ideal concurrency / latency, at
     concurrency 64 and 256: over its dispatch (backend set-up, sending, store commits; the
     sidecar's elapsed_s) and over the whole stage (plus start-up, store scan, output file);
  2. the same as a ratio to a bare httpx loop (one AsyncClient with `concurrency` connections,
     a semaphore, one task per prompt), the usual hand-written client;
  3. peak RSS of `eaglet generate` for 10k and 100k prompts (zero latency, so as fast as the
     client goes), each in a fresh process.

    .venv/bin/python -m benchmarks.generation_client     # latency 2 s (a short real answer)
    .venv/bin/python -m benchmarks.generation_client --latency 0.25 --rss ""
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from eaglet.graph.keys import build

ROOT = Path(__file__).resolve().parents[1]

KEY = "sk-bench-0000"
CAP = 32


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_llm", "--latency", str(latency), "--api-key", KEY],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def project(base: Path, url: str, n: int, concurrency: int, tag: str) -> Path:
    """A project with `n` distinct prompts and an openai backend; its prompts stage built."""
    d = base / tag
    (d / "data").mkdir(parents=True)
    with open(d / "data" / "raw.jsonl", "w") as f:
        for i in range(n):
            q = f"[{tag}] Question {i}: explain the number {i} in a few words."
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}]}) + "\n")
    params = {
        "target": {"model": "smollm2-135m-instruct"},
        "backends": {
            "api": {
                "kind": "openai",
                "base_url": f"{url}/v1",
                "model": "fake/model-1",
                "api_key_env": "BENCH_KEY",
                "concurrency": concurrency,
            }
        },
        "generation": {"backend": "api", "max_new_tokens": CAP},
        "datasets": {"d": {"path": "data/raw.jsonl", "format": "sharegpt"}},
    }
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    subprocess.run(
        [sys.executable, "-m", "eaglet", "prompts", "d", "--params", str(d / "params.yaml")],
        check=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )
    return d


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result) of one call."""
    t0, c0 = time.monotonic(), time.process_time()
    out = fn(*args)
    return time.monotonic() - t0, time.process_time() - c0, out


def run_eaglet(proj: Path) -> float:
    """The whole `generate` stage, in this process; returns its dispatch seconds."""
    from eaglet.graph.keys import sidecar_of
    from eaglet.params import load

    out = build("responses", load(proj / "params.yaml"), "d", quiet=True)
    return json.loads(sidecar_of(out).read_text())["stats"]["elapsed_s"]


def run_bare(url: str, n: int, concurrency: int, tag: str) -> None:
    """The usual loop: one client, a semaphore, one task per prompt."""

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(
            base_url=f"{url}/v1", limits=limits, timeout=60, headers=headers
        ) as client:
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int) -> None:
                q = f"[{tag}] Question {i}: explain the number {i} in a few words."
                body = {"model": "fake/model-1", "max_tokens": CAP}
                body["messages"] = [{"role": "user", "content": q}]
                async with sem:
                    r = await client.post("chat/completions", json=body)
                    r.raise_for_status()
                    r.json()

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(main())


def child_rss(proj: Path) -> tuple[float, int]:
    """(seconds, peak RSS in MiB) of `eaglet generate` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), BENCH_KEY=KEY)
    cmd = [sys.executable, "-m", "eaglet", "generate", "d", "--quiet", "--params"]
    t0 = time.monotonic()
    proc = subprocess.Popen([*cmd, str(proj / "params.yaml")], env=env, stdout=subprocess.DEVNULL)
    _, code, usage = os.wait4(proc.pid, 0)
    assert code == 0, f"generate failed ({code})"
    return time.monotonic() - t0, usage.ru_maxrss // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=float, default=2.0, help="server latency, seconds")
    ap.add_argument("--rounds", type=int, default=10, help="requests = rounds x concurrency")
    ap.add_argument("--concurrency", default="64,256", help="levels to measure ('' skips)")
    ap.add_argument("--rss", default="10000,100000", help="prompt counts for peak RSS ('' skips)")
    args = ap.parse_args()
    os.environ["BENCH_KEY"] = KEY
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-") as tmp:
        base = Path(tmp)
        server, url = start_server(args.latency)
        try:
            print(f"server latency {args.latency} s; requests = {args.rounds} x concurrency")
            levels = [int(x) for x in args.concurrency.split(",") if x]
            if levels:
                print(
                    "                 req/s: eaglet dispatch | stage |  bare   ratio "
                    "dispatch/ideal | stage/ideal | dispatch/bare   CPU ms/req eaglet | bare"
                )
            for c in levels:
                n = args.rounds * c
                proj = project(base, url, n, c, f"c{c}")
                t_e, cpu_e, t_d = timed(run_eaglet, proj)
                t_b, cpu_b, _ = timed(run_bare, url, n, c, f"bare{c}")
                ideal = c / args.latency
                d, e, b = n / t_d, n / t_e, n / t_b
                print(
                    f"C={c:<3} ideal {ideal:6.1f}: {d:15.1f} | {e:5.1f} | {b:5.1f}   "
                    f"{d / ideal:22.2f} | {e / ideal:11.2f} | {d / b:13.2f}   "
                    f"{1000 * cpu_e / n:17.2f} | {1000 * cpu_b / n:4.2f}"
                )
            server.kill()
            server.wait()
            if args.rss:
                server, url = start_server(0.0)
                print("peak RSS of `eaglet generate` (latency 0, concurrency 256):")
                for n in [int(x) for x in args.rss.split(",") if x]:
                    proj = project(base, url, n, 256, f"rss{n}")
                    secs, mib = child_rss(proj)
                    rate = n / secs
                    print(f"  {n:>7} prompts: {mib:>5} MiB peak, {secs:6.1f} s, {rate:6.0f} req/s")
        finally:
            server.kill()


if __name__ == "__main__":
    main()
