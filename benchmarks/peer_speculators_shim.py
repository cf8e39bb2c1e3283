"""speculators' own EAGLE-3 trainer on a CPU, for benchmarks/peer_speculators.py.

Runs inside speculators' venv (never eaglet's). Two commands:

    prepare DATA     the Arrow rows of DATA/rows.jsonl (input_ids, loss_mask) saved as the
                     dataset speculators reads (`datasets.load_from_disk(DATA)`, columns
                     input_ids, loss_mask, seq_len, torch format)
    train STEPS -- ARGS...
                     `speculators train ARGS` with --total-seq-len chosen so that its packing
                     sampler makes STEPS optimizer steps per epoch, and the launcher-side shim
                     below; prints one JSON line with the seconds of Trainer.run_training

The shim changes only device plumbing that assumes an accelerator, never the model, the
loss, the optimizer or the data:
  1. `speculators.train.trainer.get_local_rank` returns "cpu" (the model and each batch are
     moved to `local_rank`, device 0 of an accelerator);
  2. the Trainer's autocast device type is "cpu" (it falls back to "cuda" when
     `torch.accelerator.current_accelerator()` is None);
  3. `torch.accelerator.synchronize` is a no-op when no accelerator exists (its step timer
     synchronizes; CPU work is synchronous already);
  4. the DataLoader does not pin memory (pinning needs an accelerator).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def prepare(data: Path) -> None:
    from datasets import Dataset

    rows = [json.loads(line) for line in (data / "rows.jsonl").read_text().splitlines()]
    ds = Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "loss_mask": [r["loss_mask"] for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    )
    ds.set_format("torch")
    ds.save_to_disk(str(data))


def seq_len_for(data: str, ratio: float, steps: int, seed: int) -> int:
    """The smallest --total-seq-len whose packing gives at most `steps` batches an epoch."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(data).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * ratio)]

    def batches(n: int) -> int:
        s = MultipackDistributedBatchSamplerV2(
            batch_max_length=n, lengths=lengths, num_replicas=1, rank=0, seed=seed
        )
        return len(s)

    lo, hi = max(lengths), sum(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if batches(mid) <= steps else (mid + 1, hi)
    return lo


def install_shim() -> None:
    import speculators.train.dataloader as dataloader
    import speculators.train.trainer as trainer
    from speculators.train import cli

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    loader = torch.utils.data.DataLoader

    class UnpinnedLoader(loader):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "pin_memory": False})

    dataloader.DataLoader = UnpinnedLoader

    class CPUTrainer(trainer.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.device_type = "cpu"

        def run_training(self):
            t0 = time.perf_counter()
            super().run_training()
            self.train_seconds = time.perf_counter() - t0
            print(json.dumps({"run_training_s": round(self.train_seconds, 2)}), flush=True)

    cli.Trainer = CPUTrainer


def train(steps: int, argv: list[str]) -> None:
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    flat = cfg.flatten()
    n = seq_len_for(flat["data_path"], flat["train_data_ratio"], steps, flat["seed"])
    print(json.dumps({"total_seq_len": n, "steps_per_epoch": steps}), flush=True)
    install_shim()
    cli.main(TrainConfig.resolve([*argv, "--total-seq-len", str(n)]))


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        train(int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :])
