"""Claim: writing API answers as the target's own stream, and proving each by round trip through
vLLM's parsers, is cheap next to what the answers cost to make.

On the miniature Kimi-K2.5 (its tokenizer class and template), N answers shaped like Kimi's in
thinking mode (reasoning, answer, a tool call in one of four), measured side by side in one run:
  1. the whole responses-stage path per answer: render the prompt, write the stream in the
     `kimi_k2` grammar, tokenize, decode, read back through vLLM's kimi_k2 reasoning and tool
     parsers, compare (formats/stream.py's Writer);
  2. the same with eaglet's own reading of the grammar instead of vLLM's parsers;
  3. tokenizing the stream alone (the floor any writer pays).
Reported as generated tokens per second of one core, and as ratios to 3.

    .venv/bin/python -m benchmarks.streams                    # 400 answers of ~1.5K tokens
    .venv/bin/python -m benchmarks.streams --answers 100 --words 2000
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from eaglet.formats.grammar import grammar
from eaglet.formats.stream import Parsers, Writer
from eaglet.model.target import load_tokenizer, resolve
from tests.kimi_fixture import tiny_kimi

WORDS = ["the", "sky", "is", "blue", "because", "short", "waves", "scatter", "more", "than"]


def answers(n: int, words: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        rec = {
            "id": f"r{i}",
            "messages": [{"role": "user", "content": f"Question {i}: why?"}],
            "reasoning": text[: len(text) * 2 // 3],
            "response": text[len(text) * 2 // 3 :],
            "finish_reason": "stop",
            "output_ids": None,
        }
        if i % 4 == 0:
            args = json.dumps({"city": rng.choice(WORDS)})
            fn = {"name": "get_weather", "arguments": args}
            rec["tool_calls"] = [
                {"id": "functions.get_weather:0", "type": "function", "function": fn}
            ]
        out.append(rec)
    return out


def timed(fn, recs: list[dict]) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = sum(len(fn(r)) for r in recs)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=400)
    ap.add_argument("--words", type=int, default=1000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(resolve(str(tiny_kimi(Path(tmp) / "kimi")), trust=True))
        g = grammar("kimi_k2")
        recs = answers(a.answers, a.words)
        vllm_writer = Writer(tok, g)
        own = Writer(tok, g, parsers=Parsers(g, tok))
        own.parsers.source = "eaglet"  # eaglet's reading of the grammar
        streams = {r["id"]: g.write("<think>", _answer(r)) for r in recs}

        def tokenize(r: dict) -> list[int]:
            return tok(streams[r["id"]], add_special_tokens=False)["input_ids"]

        vllm_writer.output_ids(recs[0])  # parsers imported and built once, outside the timing
        rows = [
            (
                "write + round trip through vLLM's parsers",
                timed(vllm_writer.output_ids, recs),
            ),
            ("write + round trip through eaglet's reading", timed(own.output_ids, recs)),
            ("tokenize the stream only", timed(tokenize, recs)),
        ]
    floor = rows[-1][1][1] / rows[-1][1][0]
    print(f"{a.answers} answers of ~{rows[-1][1][1] // a.answers} tokens, one thread")
    for name, (seconds, tokens) in rows:
        rate = tokens / seconds
        print(f"  {name:<52} {rate:>10,.0f} tok/s  {rate / floor:5.2f}x tokenize")


def _answer(rec: dict):
    from eaglet.formats.grammar import Answer

    return Answer.of(rec)


if __name__ == "__main__":
    main()
