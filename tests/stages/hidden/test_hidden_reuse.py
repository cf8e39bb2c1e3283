"""Growth computes only what is new: the hidden stage reuses, per sample, states that another
complete hidden-states directory of the dataset holds (eaglet.stages.hidden.kernel.Reuse).

Real forward passes of the embedded target (SmolLM2-135M, fp32, one sequence per forward); the
oracle is the same params built from scratch in another project folder.
"""

import contextlib
import io
import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open

from eaglet.formats.hidden_store import HiddenReader, Storage, decode, encode
from eaglet.formats.io import read_jsonl, write_jsonl_zst
from eaglet.formats.records import response_record
from eaglet.graph import keys as graph_keys
from eaglet.graph.keys import Keys, sidecar_of
from eaglet.model.target import SMOLLM2, load_tokenizer, resolve
from eaglet.params import load
from eaglet.stages.hidden import run as hidden_run

from ...conftest import DEMO

# one thread: the builds of a test agree whatever it is, and on 2 shared cores one thread does
# not wait at every parallel region for a descheduled other
EXACT = {"dtype": "float32", "compute_dtype": "float32", "batch_tokens": 1, "threads": 1}
FIELDS = ("input_ids", "loss_mask", "aux", "last")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve(SMOLLM2))


@pytest.fixture(scope="module")
def forwards():
    """Counts of target loads and of sequences sent through the target's forward pass."""
    counted = {"loads": 0, "samples": 0}
    real = hidden_run.hidden_states

    def counting(*args, **kwargs):
        backend = real(*args, **kwargs)
        counted["loads"] += 1
        run = backend.run

        def run_counted(batches):
            counted["samples"] += sum(len(b) for b in batches)
            return run(batches)

        backend.run = run_counted
        return backend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hidden_run, "hidden_states", counting)
        yield counted


def project(root):
    if not (root / "data" / "demo").exists():
        shutil.copytree(DEMO, root / "data" / "demo")
    return root


def build(root, tok, forwards, max_samples, shard_mb, **storage):
    """Prompts, responses (a fixed answer per prompt id) and hidden states of `max_samples`
    ShareGPT demo prompts; the directory, its sidecar's stats, what it printed and the
    forward passes it made."""
    data = {
        "target": {"model": SMOLLM2},
        "datasets": {
            "sg": {
                "path": "data/demo/sharegpt.jsonl",
                "format": "sharegpt",
                "max_samples": max_samples,
            }
        },
        "hidden": {**EXACT, "shard_mb": shard_mb, **storage},
    }
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    params = load(path)
    records = []
    for p in read_jsonl(graph_keys.build("prompts", params, "sg")):
        text = f"Answer {p['id'][:6]}: light scatters, so the sky looks blue."
        ids = tok(text, add_special_tokens=False)["input_ids"] + [2]
        result = {
            "response": text,
            "output_ids": ids,
            "prompt_tokens": 0,
            "completion_tokens": len(ids),
            "finish_reason": "stop",
            "model": SMOLLM2,
            "latency_s": 0.0,
        }
        records.append(response_record(p, result, "local", {}))
    write_jsonl_zst(Keys(params).path("responses", "sg"), records)
    before = dict(forwards)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out = graph_keys.build("hidden", params, "sg", quiet=True)
    stats = json.loads(sidecar_of(out).read_text())["stats"]
    made = {k: forwards[k] - before[k] for k in forwards}
    return out, stats, err.getvalue(), made


def arrays(path):
    return {s["id"]: s for s in HiddenReader(path)}


def assert_same_arrays(got, want):
    assert list(got) == list(want)
    for sid, s in got.items():
        assert all(torch.equal(s[k], want[sid][k]) for k in FIELDS), sid


def raw(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def grown(tmp_path_factory, tok, forwards):
    """max_samples 8 (0.5 MB shards), then 12 (1 MB shards) in one project; 12 from scratch
    in another (the oracle)."""
    root = project(tmp_path_factory.mktemp("grow"))
    small = build(root, tok, forwards, 8, 0.5)
    large = build(root, tok, forwards, 12, 1)
    oracle = build(project(tmp_path_factory.mktemp("oracle")), tok, forwards, 12, 1)
    return root, small, large, oracle


def test_growth_computes_only_the_new_samples(grown):
    _, small, large, oracle = grown
    (a, a_stats, _, a_made), (b, b_stats, err, b_made) = small, large
    assert (a_stats["reused"], a_stats["computed"], a_stats["reused_from"]) == (0, 8, [])
    assert a_made == {"loads": 1, "samples": 8}
    assert (b_stats["reused"], b_stats["computed"], b_stats["reused_from"]) == (8, 4, [a.name])
    assert b_made == {"loads": 1, "samples": 4}  # the forward passes, counted at the backend
    assert "hidden sg: 8 of 12 samples reused from 1 other key" in err
    o, o_stats, _, o_made = oracle
    assert (o_stats["computed"], o_made["samples"]) == (12, 12)
    assert o.name == b.name  # the same params and data: the same key
    assert_same_arrays(arrays(b), arrays(o))
    assert files(b) == files(o)  # every byte: shards and manifest
    assert len(HiddenReader(a).manifest["shards"]) > 1  # the reuse read across shards


def test_shrinking_computes_nothing_and_loads_no_target(grown, tok, forwards):
    root, (a, *_), (b, *_), _ = grown
    c, stats, err, made = build(root, tok, forwards, 8, 2)  # another shard size: another key
    assert c.name not in (a.name, b.name)
    assert (stats["reused"], stats["computed"]) == (8, 0)
    assert made == {"loads": 0, "samples": 0}  # the target was never loaded
    assert "hidden sg: 8 of 8 samples reused from 1 other key" in err
    assert_same_arrays(arrays(c), arrays(a))  # a's were computed from scratch
    assert HiddenReader(c).manifest["compute_dtype"] == "float32"


def test_a_damaged_source_is_skipped_and_its_samples_computed(grown, tok, forwards, tmp_path):
    _, _, (b, *_), (o, *_) = grown
    root = project(tmp_path)
    shutil.copytree(o, root / "data" / "hidden" / "sg" / o.name)
    shutil.copy(sidecar_of(o), root / "data" / "hidden" / "sg" / sidecar_of(o).name)
    source = root / "data" / "hidden" / "sg" / o.name
    meta = HiddenReader(source).manifest
    bad = meta["samples"][-2]["shard"]  # a late shard: those before it read and verified
    data = bytearray((source / bad).read_bytes())
    data[-100] ^= 0xFF  # one flipped byte
    (source / bad).write_bytes(data)
    d, stats, err, made = build(root, tok, forwards, 12, 0.5)
    lines = [line for line in err.splitlines() if "not reusing" in line]
    assert len(lines) == 1 and o.name in lines[0] and bad in lines[0] and "sha256" in lines[0]
    first_bad = next(i for i, m in enumerate(meta["samples"]) if m["shard"] == bad)
    # what came before the damaged shard was read from verified shards; the rest is computed
    assert (stats["reused"], stats["computed"]) == (first_bad, 12 - first_bad)
    assert made["samples"] == stats["computed"] and first_bad > 0
    assert_same_arrays(arrays(d), arrays(b))


def test_fp8_reuse_writes_the_bytes_a_computation_writes(grown, tok, forwards, tmp_path):
    """FP8 in a bfloat16 storage: the states, read back dequantized in float32, quantize to the
    very bytes stored (scales included), so reused samples are encoded like computed ones."""
    _, _, (b, *_), _ = grown
    fp8 = {"dtype": "bfloat16", "compress": "zstd", "fp8": True}
    root = project(tmp_path)
    e, e_stats, _, _ = build(root, tok, forwards, 4, 1, **fp8)
    assert e_stats["computed"] == 4  # float32 storage's states are other states: not reused
    f, f_stats, _, made = build(root, tok, forwards, 4, 2, **fp8)
    assert (f_stats["reused"], f_stats["computed"], made["loads"]) == (4, 0, 0)
    want, got = HiddenReader(e).manifest["samples"], HiddenReader(f).manifest["samples"]
    for meta in got:
        source = next(m for m in want if m["id"] == meta["id"])
        with safe_open(e / source["shard"], "pt") as x, safe_open(f / meta["shard"], "pt") as y:
            names = [n for n in x.keys() if n.startswith(f"{meta['id']}/")]  # noqa: SIM118
            assert len(names) == 6  # ids, mask, aux, last and the two FP8 scales
            for n in names:
                assert torch.equal(raw(x.get_tensor(n)), raw(y.get_tensor(n))), n
    # every storage: real fp32 states, stored, read back in float32 and stored again, are the
    # same tensors; read back in bfloat16, FP8 rows are not (why reuse reads in float32)
    exact = next(iter(HiddenReader(b)))
    T = len(exact["input_ids"])
    for dtype in ("bfloat16", "float32"):
        for compress in ("none", "zstd"):
            for quantized in (False, True):
                st = Storage(dtype, compress, quantized)
                enc = encode(exact, st)
                back = decode(enc.__getitem__, T, 3, 576, st, "float32")
                again = encode({**exact, **back}, st)
                assert all(torch.equal(raw(enc[k]), raw(again[k])) for k in enc), st
    st = Storage(**fp8)
    enc = encode(exact, st)
    rounded = encode({**exact, **decode(enc.__getitem__, T, 3, 576, st, "bfloat16")}, st)
    assert not torch.equal(enc["aux_scale"], rounded["aux_scale"])


def test_a_killed_growth_resumes_its_reused_shards(grown, tok, forwards, tmp_path):
    """The partial directory's plan names the samples, not where their states came from: a
    build killed after writing the reused shards resumes from them."""
    _, (a, *_), _, (o, *_) = grown
    root = project(tmp_path)
    folder = root / "data" / "hidden" / "sg"
    shutil.copytree(a, folder / a.name)
    shutil.copy(sidecar_of(a), folder / sidecar_of(a).name)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill between the reused shards and the first forward

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hidden_run, "hidden_states", killed)
        with pytest.raises(KeyboardInterrupt):
            build(root, tok, forwards, 12, 1)
    partial = folder / f".{o.name}.partial"
    journal = (partial / "journal.jsonl").read_text().splitlines()
    assert len(journal) == 1 + 8  # the plan, then the 8 reused shards
    kept = {p.name: p.stat().st_ino for p in partial.glob("shard-*")}
    out, stats, err, made = build(root, tok, forwards, 12, 1)
    assert "resuming: 8 of 12 shards complete" in err
    assert (stats["resumed"], stats["reused"], stats["computed"]) == (8, 0, 4)
    assert made == {"loads": 1, "samples": 4}
    assert all((out / name).stat().st_ino == ino for name, ino in kept.items())
    assert files(out) == files(o)
