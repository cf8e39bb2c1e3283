"""Train a drafter for the tiny target in its own process (for kill/resume and torchrun tests).

    python tests/train_tiny.py BUNDLE OUT [--batch-size B] [--grad-accum A] [--max-steps N]
                               [--checkpoint-every K] [--step-sleep S] [--reads FILE] [--chain N]

BUNDLE is a torch.save of tests.hidden_fixture.bundle(). Prints the training stats as JSON on
rank 0. --step-sleep slows each step (so that a test can kill it midway). --reads writes, per
process (FILE.<rank>), the sample ids training announced it would read (`expect`, what an online
reader prefetches) and those it read. --chain trains every batch as a long one: step 0 whole,
then TTT steps 1.. in chunks of N positions, recomputed in backward (drafter.CHAIN).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hidden_fixture import fit_tiny


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--reads", type=Path)
    ap.add_argument("--chain", type=int)
    args = ap.parse_args()
    if args.chain:
        from eaglet.model import drafter

        drafter.RECOMPUTE, drafter.CHAIN = 0, args.chain
    if args.reads:
        record_reads(args.reads)
    torch.set_num_threads(1)
    if args.step_sleep:
        from eaglet.progress import Progress

        update = Progress.update

        def slow_update(self, *a, **kw):
            time.sleep(args.step_sleep)
            return update(self, *a, **kw)

        Progress.update = slow_update
    stats = fit_tiny(
        torch.load(args.bundle, weights_only=False),
        args.out,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        max_steps=args.max_steps,
        epochs=100,
        checkpoint_every=args.checkpoint_every,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(stats))


def record_reads(path: Path) -> None:
    """Record what the tiny reader is told to expect and what it is asked for."""
    import atexit

    from tests.hidden_fixture import MemoryReader

    log: dict = {"expected": [], "read": []}
    get = MemoryReader.get

    def expect(self, refs):
        log["expected"] += [sid for _, sid in refs]

    def recorded(self, sid):
        log["read"].append(sid)
        return get(self, sid)

    MemoryReader.expect, MemoryReader.get = expect, recorded
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: Path(f"{path}.{rank}").write_text(json.dumps(log)))


if __name__ == "__main__":
    main()
