"""Claims: (1) drafter training throughput on CPU, bf16 autocast vs fp32, side by side;
(2) the acceptance length the demo reaches after a fixed budget of optimizer steps.

On the demo drafter of params.yaml (SmolLM2 target, its demo datasets' stored hidden states:
build them first, e.g. `make demo`), with the draft vocab picked from the same data:
  1. `train_kernel.fit` for --steps steps in fp32 and in bf16, alternately, --runs times each:
     assistant tokens per second (best and median);
  2. a bf16 drafter trained for --budget steps, then real speculative decoding (greedy, chain,
     3 and 7 steps) on --prompts held-out prompts: acceptance length, greedy equality, and the
     offline estimate from the held-out hidden states.
CPU pressure is shown next to the numbers.

    .venv/bin/python -m benchmarks.drafter [--steps 10] [--runs 2] [--budget 600] [--prompts 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import pressure
from eaglet.formats.chat import stop_ids
from eaglet.formats.drafter import load_drafter
from eaglet.formats.metrics import offline_json, run_json, steps_key
from eaglet.graph.keys import Keys
from eaglet.model import speculative
from eaglet.model.drafter import DrafterConfig
from eaglet.model.target import load_config, load_head, load_model, load_tokenizer, spec_of
from eaglet.params import load
from eaglet.stages.evaluate import kernel as evaluate_kernel
from eaglet.stages.hidden import read as hidden_read
from eaglet.stages.train import kernel as train_kernel
from eaglet.stages.train.spec import TrainHyper
from eaglet.stages.vocab import kernel as vocab_kernel

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--drafter", default="demo")
    ap.add_argument("--steps", type=int, default=10, help="steps per throughput run")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget", type=int, default=600, help="steps before measuring acceptance")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load(args.params)
    readers = hidden_read.open_readers(hidden_read.states(params, args.drafter))
    d = params.drafter(args.drafter)
    prov = Keys(params).provenance("train", args.drafter)
    hp = prov["params"]["train"] | {"heldout_fraction": d["heldout_fraction"]}
    spec = spec_of(params)
    size = d["draft_vocab_size"]
    d2t, t2d = vocab_kernel.select(
        vocab_kernel.count_tokens(readers, readers[0].manifest["target"]["vocab_size"]), size
    )
    cfg = DrafterConfig.from_target(
        load_config(spec), size, readers[0].manifest["aux_layer_ids"]["sglang"]
    )
    embed, lm_head = load_head(spec)
    print(f"# cpu pressure before: {pressure()}")

    with tempfile.TemporaryDirectory() as tmp:

        def fit(name: str, **over) -> dict:
            return train_kernel.fit(
                readers,
                cfg,
                {"embed": embed, "lm_head": lm_head, "d2t": d2t, "t2d": t2d},
                TrainHyper.of(hp | over),
                Path(tmp) / name,
                10**9,
                quiet=True,
            )

        rates: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        for i in range(args.runs):
            for dtype in rates:
                st = fit(f"{dtype}-{i}", dtype=dtype, max_steps=args.steps, epochs=10**6)
                rates[dtype].append(st["tokens_per_s"])
        for dtype, r in rates.items():
            print(f"train {dtype:8s}: best {max(r):7.1f} tok/s, median {statistics.median(r):7.1f}")
        ratio = max(rates["bfloat16"]) / max(rates["float32"])
        print(f"train bf16 / fp32 throughput: {ratio:.2f}x  (cpu {pressure()})")

        st = fit("budget", dtype="bfloat16", max_steps=args.budget)
        print(
            f"trained {st['steps']} steps in {st['elapsed_s']:.0f} s, held-out acc per TTT step "
            f"{[round(a, 3) for a in st['heldout']['acc']]}"
        )
        model = load_drafter(Path(tmp) / "budget")
    target_model = load_model(spec, "cpu", "float32")
    stop = set(stop_ids(load_tokenizer(spec), target_model))
    _, held = hidden_read.split(readers, d["heldout_fraction"])
    prompts = evaluate_kernel.heldout_prompts(readers, held, args.prompts)
    target = speculative.Target(target_model, list(model.cfg.aux_layer_ids))
    decode = dataclasses.replace(
        Keys(params).spec("evaluate", args.drafter).values.settings, num_steps=(3, 7)
    )
    real = evaluate_kernel.decode_all(target, model, prompts, decode, stop, quiet=True)
    est = evaluate_kernel.offline(model, readers, held, target_model.lm_head.weight, [3, 7])
    for n in (3, 7):
        m, offline = real[n], est[n].acceptance_length
        print(
            f"{steps_key(n)}: acceptance length {m.acceptance_length:.3f} over {len(prompts)} "
            f"prompts (offline estimate {offline:.3f}), greedy equal {m.greedy.greedy_equal}, "
            f"{m.tokens_per_s:.1f} tok/s vs {m.greedy.greedy_tokens_per_s:.1f} greedy "
            f"({m.greedy.speedup:.2f}x)"
        )
    speculative_json = {steps_key(n): run_json(r) for n, r in real.items()}
    offline_est = {steps_key(n): offline_json(o) for n, o in est.items()}
    print(
        json.dumps({"throughput": rates, "speculative": speculative_json, "offline": offline_est})
    )
    print(f"# cpu pressure after: {pressure()}")


if __name__ == "__main__":
    main()
