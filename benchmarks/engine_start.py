"""vLLM's CPU build at one rank: start-up with the model in the engine core's process (eaglet's
ServeConfig: `--distributed-executor-backend uni`) against vLLM's default there (a worker process
of its own, one more vLLM import), and the same greedy text from both.

The two ways alternate, `--runs` times each, in one run of this script; medians are printed with
the machine's CPU pressure, so read the ratio, not the seconds.

    .venv/bin/python -m benchmarks.engine_start --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import urllib.request

from eaglet.engines.vllm.config import ServeConfig
from eaglet.engines.vllm.server import Engine
from eaglet.model.target import materialize, resolve

from .common import pressure

PROMPTS = ["Write a haiku about the sea.", "What is 2+2?", "List three colors."]


class Worker(ServeConfig):
    """vLLM's own default on the CPU build: the model in a worker process of its own."""

    @property
    def in_one_process(self) -> bool:
        return False


def greedy(url: str, name: str, tokens: int) -> list[str]:
    out = []
    for p in PROMPTS:
        body = {"model": name, "prompt": p, "max_tokens": tokens, "temperature": 0}
        req = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            out.append(json.loads(r.read())["choices"][0]["text"])
    return out


def once(config: ServeConfig, tokens: int) -> tuple[float, float, list[str]]:
    """(start-up s, generation s, greedy texts) of one server's life."""
    with Engine(config) as engine:
        t = time.monotonic()
        texts = greedy(engine.url, config.served_name, tokens)
        return engine.startup_s or 0.0, time.monotonic() - t, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    model = materialize(resolve("smollm2-135m-instruct"))
    one = ServeConfig(model=model, served_name="s")
    two = Worker(**{f.name: getattr(one, f.name) for f in dataclasses.fields(one)})
    print(pressure())
    times: dict[str, list[tuple[float, float]]] = {"one process": [], "worker process": []}
    texts = {}
    for _ in range(args.runs):
        for label, config in (("one process", one), ("worker process", two)):
            start, gen, texts[label] = once(config, args.tokens)
            times[label].append((start, gen))
            print(f"{label:15s} start-up {start:6.1f} s  generation {gen:5.1f} s", flush=True)
    for label, rows in times.items():
        start = statistics.median(r[0] for r in rows)
        gen = statistics.median(r[1] for r in rows)
        print(f"median {label:15s} start-up {start:6.1f} s  generation {gen:5.1f} s")
    one_s, two_s = (statistics.median(r[0] for r in times[k]) for k in times)
    same = len({tuple(t) for t in texts.values()}) == 1
    print(f"start-up one / worker process: {one_s / two_s:.2f}x; greedy text equal: {same}")
    print(pressure())


if __name__ == "__main__":
    main()
