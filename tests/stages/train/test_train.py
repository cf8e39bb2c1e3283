"""Training: kill -9 then resume gives the uninterrupted weights; DDP and gradient accumulation
give the single-process result for the same global batch, also the way long batches train."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ...conftest import ROOT
from ...hidden_fixture import bundle, hyper

SCRIPT = ROOT / "tests" / "train_tiny.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "bundle.pt"
    torch.save(bundle(), path)
    return path


def run(tiny, *args, launcher=()) -> dict:
    r = subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), str(tiny), *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def weights(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_resume_after_kill_gives_the_same_weights(tiny, tmp_path):
    full = run(tiny, tmp_path / "full", "--max-steps", 9)
    assert full["resumed_from"] == 0 and full["steps"] == 9

    killed = tmp_path / "killed"
    args = [killed, "--max-steps", 9, "--checkpoint-every", 3]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tiny), *map(str, args), "--step-sleep", "0.5"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = tmp_path / ".killed.work" / "checkpoint.pt"
    info = ckpt.with_name("checkpoint.json")  # written right after each checkpoint
    deadline = time.monotonic() + 120
    while not info.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.exists() and info.exists(), "no checkpoint before the run ended"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not killed.exists()  # the output only appears complete
    from eaglet.reports.status import _partial

    at = _partial(killed, "train")  # what `eaglet status` shows: the step, without loading it
    assert at["step"] in (3, 6) and at["total"] == 9

    torn = tmp_path / ".torn.work"  # a damaged checkpoint: one line naming it, nothing built
    torn.mkdir()
    (torn / "checkpoint.pt").write_bytes(ckpt.read_bytes()[:100])
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny), str(tmp_path / "torn"), "--max-steps", "9"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "checkpoint.pt: unreadable checkpoint" in r.stderr
    assert "delete it to train from the start" in r.stderr and not (tmp_path / "torn").exists()

    resumed = run(tiny, *args)
    assert resumed["resumed_from"] in (3, 6)
    a, b = weights(tmp_path / "full"), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rows(tmp_path / "full") == rows(killed)  # the metrics of every step, too
    assert not (tmp_path / ".killed.work").exists()


def test_ddp_and_accumulation_equal_one_process_with_the_same_global_batch(tiny, tmp_path):
    reads = ("--reads", tmp_path / "reads")
    one = run(
        tiny,
        tmp_path / "one",
        "--batch-size",
        4,
        "--max-steps",
        4,
    )
    accum = run(tiny, tmp_path / "accum", "--batch-size", 2, "--grad-accum", 2, "--max-steps", 4)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ddp = run(
        tiny, tmp_path / "ddp", "--batch-size", 2, "--max-steps", 4, *reads, launcher=torchrun
    )
    # and as long batches train: TTT steps 1.. in chunks of 3 positions, recomputed in backward
    chunked = ("--batch-size", 2, "--max-steps", 4, "--chain", 3)
    ddp_chunked = run(tiny, tmp_path / "ddp_chunked", *chunked, launcher=torchrun)
    # each rank reads its own half of every global batch, in the order it announced (what an
    # online reader prefetches); rank 0 alone reads the held-out samples
    r0, r1 = (json.loads((tmp_path / f"reads.{r}").read_text()) for r in (0, 1))
    assert r0["read"] == r0["expected"] and r1["read"] == r1["expected"]
    assert len(r1["read"]) == 4 * 2 and not set(r1["read"]) & set(r0["read"][:8])
    processes = [run["processes"] for run in (one, accum, ddp, ddp_chunked)]
    assert processes == [1, 1, 2, 2]
    ref = rows(tmp_path / "one")
    for other in ("accum", "ddp", "ddp_chunked"):
        got = rows(tmp_path / other)
        for r, g in zip(ref, got, strict=True):
            for col in ("loss", "acc_0", "acc_2", "grad_norm"):
                assert abs(float(r[col]) - float(g[col])) <= 1e-5 * max(1.0, abs(float(r[col])))
        a, b = weights(tmp_path / "one"), weights(tmp_path / other)
        # rounding differs in the last bits; Adam amplifies it on near-zero gradients
        assert all(torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4) for k in a), other
    assert float(ref[-1]["loss"]) < float(ref[0]["loss"])  # it learns


class Lengths:
    """A reader's manifest alone: sample ids and token counts."""

    def __init__(self, *tokens: int):
        self.manifest = {"samples": [{"id": f"s{i}", "tokens": n} for i, n in enumerate(tokens)]}


def test_overlong_samples_are_cut_or_skipped_and_counted():
    from eaglet.stages.train import data as train_data

    readers = [Lengths(10, 50), Lengths(33, 32)]
    refs = [(0, "s0"), (0, "s1"), (1, "s0"), (1, "s1")]
    kept, cut = train_data.overlong(readers, refs, 32, "truncate")
    assert kept == refs and cut == {"policy": "truncate", "samples": 2, "tokens_lost": 18 + 1}
    kept, skipped = train_data.overlong(readers, refs, 32, "skip")
    assert kept == [(0, "s0"), (1, "s1")]
    assert skipped == {"policy": "skip", "samples": 2, "tokens_lost": 50 + 33}


def test_a_sample_that_would_not_fit_the_gpu_is_one_error_before_training():
    from eaglet.errors import EagletError
    from eaglet.model import drafter, target_head, train_memory
    from eaglet.model.drafter import DrafterConfig
    from eaglet.stages.train import run as train_run

    constants = (train_memory.LOGITS, train_memory.SCORES, train_memory.CHAIN)
    assert constants == (target_head.LOGITS, drafter.SCORES, drafter.CHAIN)

    cfg = DrafterConfig(
        vocab_size=1000, draft_vocab_size=100, hidden_size=64, target_hidden_size=64,
        intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=8192, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    hp = hyper(ttt_length=3, batch_size=2, dtype="bfloat16", max_length=6000)
    shape = train_memory.Shape.of(cfg.to_dict(), 64, 1000, 100, 3)
    memory = int(train_memory.estimate(shape, 2 * 4000, "bfloat16")["peak"])  # 4,000 tokens fit
    readers, names = [Lengths(100, 3000), Lengths(5000, 200)], ["short", "long"]
    with pytest.raises(EagletError, match=r"dataset long: a sample of 5,000 tokens \(batch 2\)"):
        train_run.check_fits(readers, names, cfg, hp, memory)
    train_run.check_fits(readers, names, cfg, replace(hp, max_length=4000), memory)  # cut: fits
    train_run.check_fits(readers, names, cfg, replace(hp, max_length=4000, overlong="skip"), memory)
