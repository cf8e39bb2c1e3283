"""The hidden-states stage on the embedded target (SmolLM2, 30 layers, H=576)."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import yaml

from eaglet import cli
from eaglet.errors import EagletError
from eaglet.formats.chat import prompt_ids
from eaglet.formats.grammar import grammar
from eaglet.formats.hidden_store import HiddenReader, Storage, decode, encode
from eaglet.formats.io import read_jsonl, write_jsonl_zst
from eaglet.formats.records import response_record
from eaglet.formats.stream import Writer
from eaglet.graph.keys import Keys, build, sidecar_of
from eaglet.model.target import SMOLLM2, load_model, load_tokenizer, resolve
from eaglet.params import load
from eaglet.reports import status
from eaglet.stages.hidden.verify import verify

from ...cli import command, environ
from ...conftest import DEMO
from ...sglang_server import SGLangServer

EXACT = {"dtype": "float32", "compute_dtype": "float32", "batch_tokens": 1, "shard_mb": 0.5}


def params_for(root, name="params.yaml", **hidden_cfg):
    data = {
        "target": {"model": SMOLLM2},
        "datasets": {"sg": {"path": "data/demo/sharegpt.jsonl", "format": "sharegpt"}},
        "hidden": {"threads": 2, **hidden_cfg},
    }
    data["datasets"]["sg"]["max_samples"] = 4
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return load(path)


@pytest.fixture(scope="module")
def smol():
    spec = resolve(SMOLLM2)
    return load_tokenizer(spec), load_model(spec, "cpu", "float32")


@pytest.fixture(scope="module")
def built(tmp_path_factory, smol):
    """A project with real prompt records, responses written for them, and an exact fp32 build.

    Responses 0 and 2 carry the engine's output_ids (as the local and SGLang backends record
    them); 1 and 3 are text (as from an API) written in SmolLM2's grammar as the responses stage
    does, 3 cut by length.
    """
    tok, _ = smol
    root = tmp_path_factory.mktemp("hidden")
    shutil.copytree(DEMO, root / "data" / "demo")
    params = params_for(root, **EXACT)
    keys = Keys(params)
    records, writer = [], Writer(tok, grammar("chatml"))
    for i, p in enumerate(read_jsonl(build("prompts", params, "sg"))):
        text = f"Answer {i}: light scatters, so the sky looks blue."
        ids = tok(text, add_special_tokens=False)["input_ids"] + [2] if i % 2 == 0 else None
        result = {
            "response": text,
            "output_ids": ids,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "finish_reason": "length" if i == 3 else "stop",
            "model": SMOLLM2,
            "latency_s": 0.0,
        }
        rec = response_record(p, result, "local", {})
        if ids is None:
            rec["output_ids"] = writer.output_ids(rec)
        records.append(rec)
    write_jsonl_zst(keys.path("responses", "sg"), records)
    out = build("hidden", params, "sg", quiet=True)
    return root, params, records, out


def test_states_masks_and_manifest_equal_a_direct_forward(built, smol):
    tok, model = smol
    _, _, records, out = built
    assert out == Keys(built[1]).path("hidden", "sg") and not (out / "journal.jsonl").exists()
    reader = HiddenReader(out)
    m = reader.manifest
    assert m["aux_layer_ids"] == {
        "sglang": [1, 14, 26],
        "vllm": [2, 15, 27],
        "hf_hidden_states_index": [2, 15, 27],
    }
    t = m["target"]
    assert (t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]) == (30, 576, 49152)
    assert len(t["config_sha256"]) == 64 and t["model"] == SMOLLM2
    assert len(m["shards"]) > 1  # shard_mb 0.5: the reader crosses shards
    st = m["stats"]
    assert (st["from_output_ids"], st["unfinished"], st["truncated"]) == (4, 1, 0)
    assert reader.ids == [r["id"] for r in records] and len(reader) == 4
    samples = list(reader)
    for rec, s in zip(records, samples, strict=True):
        prompt = prompt_ids(tok, rec["messages"])
        turn = s["input_ids"][s["loss_mask"]].tolist()
        assert s["input_ids"][: len(prompt)].tolist() == prompt
        assert not s["loss_mask"][: len(prompt)].any() and s["loss_mask"][len(prompt) :].all()
        assert turn == rec["output_ids"]  # exactly the generated ids, stop token included
        end = "" if rec["finish_reason"] == "length" else "<|im_end|>"  # its own, unless cut
        assert tok.decode(turn) == rec["response"] + end
        with torch.inference_mode():
            hs = model(s["input_ids"][None], output_hidden_states=True).hidden_states
        assert torch.equal(s["aux"], torch.stack([hs[k][0] for k in (2, 15, 27)], dim=1))
        assert torch.equal(s["last"], hs[-1][0])  # post-norm: the lm_head input
        assert torch.equal(reader.get(s["id"])["aux"], s["aux"])
        assert s["aux"].dtype == torch.float32 and s["input_ids"].dtype == torch.long


def test_zstd_exact_and_fp8_bounded_on_real_activations(built):
    sample = next(iter(HiddenReader(built[3])))
    T = len(sample["input_ids"])
    for st in (Storage("bfloat16", "zstd"), Storage("float32", "zstd")):
        enc = encode(sample, st)
        dec = decode(enc.__getitem__, T, 3, 576, st)
        for name in ("aux", "last"):
            assert torch.equal(dec[name], sample[name].to(dec[name].dtype))
        raw = st.itemsize * T * 4 * 576
        assert enc["aux"].numel() + enc["last"].numel() < 0.95 * raw
    fp8 = Storage("float32", fp8=True)
    enc = encode(sample, fp8)
    dec = decode(enc.__getitem__, T, 3, 576, fp8)
    for name in ("aux", "last"):
        x, scale = sample[name], enc[f"{name}_scale"].unsqueeze(-1)
        # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative; subnormal half-step 2^-10 x scale
        bound = 2**-4 * x.abs() + 2**-10 * scale + 1e-6 * x.abs()
        assert ((dec[name] - x).abs() <= bound).all()
        assert enc[name].dtype == torch.float8_e4m3fn


def test_sglang_server_gives_the_same_manifest_and_shards(built, smol):
    _, model = smol
    root, _, _, out = built
    with (
        SGLangServer(model, "aux", [1, 14, 26], faults=["503"]) as aux,
        SGLangServer(model, "full", [1, 14, 26]) as full,
    ):
        params = params_for(
            root, "sglang.yaml", **EXACT, backend="sglang", url=aux.url, last_url=full.url
        )
        other = build("hidden", params, "sg", out=root / "via-sglang", quiet=True)
    assert aux.requests == 1 + 4  # one 503 retried, then one request per sequence
    a, b = HiddenReader(out).manifest, HiddenReader(other).manifest
    assert b["backend"] == "sglang" and a["key"] != b["key"]
    differ = {"key", "backend", "last"}  # last: how each backend reached the final state
    assert {k: v for k, v in a.items() if k not in differ} == {
        k: v for k, v in b.items() if k not in differ
    }  # shard sha256s included: identical bytes


@pytest.mark.engine
def test_vllm_engine_states_equal_the_transformers_forward(built, tmp_path):
    """One vLLM engine (extract_hidden_states, eaglet's CPU connector) on the same ids: the
    states equal the in-process forward's within fp32 noise, the tokens and masks exactly, and
    the engine's spool is empty afterwards. The reference then verifies the engine's shards."""
    root, _, _, out = built
    spool = tmp_path / "spool"
    spool.mkdir()  # given, so the test can see it emptied (unset: a temporary one, removed)
    params = params_for(root, "vllm.yaml", **EXACT, backend="vllm", spool=str(spool))
    engine = build("hidden", params, "sg", out=root / "via-vllm", quiet=True)
    assert not pgrep(str(spool)) and not any(spool.iterdir())
    ref, got = HiddenReader(out), HiddenReader(engine)
    assert got.manifest["backend"] == "vllm" and got.ids == ref.ids
    assert got.manifest["last"]["how"].startswith("last layer output from the engine")
    worst = 0.0
    for sid in ref.ids:
        a, b = ref.get(sid), got.get(sid)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux", "last"):
            x, y = a[name].flatten(0, -2), b[name].flatten(0, -2)
            worst = max(worst, float(((x - y).norm(dim=-1) / x.norm(dim=-1)).max()))
    assert worst < 1e-4  # measured 9.4e-6; a layer off by one is > 0.4 away
    report = verify(params_for(root, **EXACT), "sg", path=engine)  # the transformers reference
    assert report["ok"] and report["max_relative_error"] < 1e-4


def pgrep(pattern: str) -> list[str]:
    """The processes whose command line holds `pattern` (this test's own paths: tests in other
    workers run servers of their own)."""
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return r.stdout.split()


def test_verify_passes_then_catches_a_corrupted_shard(built, tmp_path, capsys):
    _, params, _, out = built
    report = verify(params, "sg")
    assert report["ok"] and report["samples_checked"] == 4 and report["max_relative_error"] == 0
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    sid = HiddenReader(bad).ids[0]
    shard = bad / HiddenReader(bad).manifest["samples"][0]["shard"]
    data = bytearray(shard.read_bytes())
    header = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header])[f"{sid}/aux"]["data_offsets"]
    mid = 8 + header + (start + end) // 2
    data[mid : mid + 64] = b"\x7f" * 64  # a run of huge float32 values
    shard.write_bytes(data)
    argv = ["hidden", "sg", "--verify", "--out", str(bad), "--params", str(params.path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "content differs from the manifest (sha256)" in err
    assert f"sample {sid}: aux relative error" in err


def test_bf16_zstd_batched_within_rounding_and_status_bytes(built, capsys):
    root, _, _, exact = built
    params = params_for(root, "bf16.yaml", compress="zstd")  # defaults: bf16, batched, 256 MB
    out = build("hidden", params, "sg", quiet=True)
    for ref, s in zip(HiddenReader(exact), HiddenReader(out), strict=True):
        for name in ("aux", "last"):
            want = ref[name].to(torch.bfloat16).float()
            assert s[name].dtype == torch.bfloat16
            # rounding to bf16 (8 bits, 1 ulp) of fp32 states that batching moved by ~1e-6 of
            # the state's norm (on an AMX CPU a near-zero element moves by 2 ulps of itself)
            floor = 1e-6 * ref[name].norm(dim=-1, keepdim=True)
            assert ((s[name].float() - want).abs() <= 2**-7 * want.abs() + floor).all()
    row = next(r for r in status.collect(params) if r["stage"] == "hidden")
    st = row["stats"]
    disk = sum(p.stat().st_size for p in out.iterdir())
    assert row["state"] == "up to date" and row["disk_bytes"] == disk
    assert st["state_bytes_per_token"] == 4 * 576 * 2
    ratio = disk / st["tokens"] / st["state_bytes_per_token"]
    assert 0.5 < ratio < 0.95  # zstd on byte planes of real bf16 activations
    status.show(params)
    shown = f"{disk / st['tokens']:.0f} B/tok on disk = 4608 x {ratio:.3f}"
    assert shown in capsys.readouterr().out


@pytest.mark.slow
def test_killed_run_resumes_from_the_last_complete_shard(built, capsys):
    root, _, _, exact = built
    params = params_for(root, "kill.yaml", **{**EXACT, "shard_mb": 0.2})  # a shard per sample
    final = Keys(params).path("hidden", "sg")
    partial = final.parent / f".{final.name}.partial"
    journal = partial / "journal.jsonl"
    cmd = command("hidden", "sg", params=params.path)
    # the exact build beside it holds every state (hidden.Reuse): out of sight, the killed run
    # computes its shards, as this test means, and is slow enough to be killed midway
    side = sidecar_of(exact)
    side.rename(side.with_suffix(".off"))
    # the reference's threads: on an AMX CPU one thread and two round differently
    proc = subprocess.Popen([*cmd, "--quiet"], env=environ(), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    beacon = partial / "progress.json"  # written after each shard's journal line
    while not (journal.exists() and journal.read_text().count("\n") >= 2 and beacon.exists()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    running = next(r for r in status.collect(params) if r["stage"] == "hidden")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # while it ran, `eaglet status` read its beacon: samples done of all, tokens/s, ETA
    beat = running["partial"]["progress"]
    assert running["state"] == "partial" and "running" in running["next"]
    assert 0 < beat["done"] <= beat["total"] == 4 and beat["unit"] == "seq" and beat["tok_s"] > 0
    assert f"{beat['done']}/4 seq" in status._summary(running)
    assert not final.exists()  # a killed build never looks finished
    done = [json.loads(line)["name"] for line in journal.read_text().splitlines()[1:]]
    assert 1 <= len(done) < 4
    kept = {n: (partial / n).stat() for n in done}
    with open(journal, "a") as f:  # as if killed mid-append, with a stray temp shard
        f.write('{"name": "shard-0000')
    (partial / ".shard-00003.safetensors.tmp-x").write_bytes(b"partial")
    assert cli.main(["hidden", "sg", "--quiet", "--params", str(params.path)]) == 0
    side.with_suffix(".off").rename(side)
    assert f"resuming: {len(done)} of 4 shards complete" in capsys.readouterr().err
    assert not partial.exists()
    for name, before in kept.items():  # completed shards were kept, not recomputed
        after = (final / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    resumed = HiddenReader(final)
    assert len(resumed.manifest["shards"]) == 4 and not resumed.check_shards()
    for ref, s in zip(HiddenReader(exact), resumed, strict=True):
        assert all(torch.equal(ref[k], s[k]) for k in ("input_ids", "loss_mask", "aux", "last"))


def test_bad_inputs_are_one_line_errors(built, tmp_path):
    root = built[0]
    params = params_for(root, "bad.yaml", aux_layer_ids=[1, 30])
    with pytest.raises(EagletError, match=r"hidden\.aux_layer_ids: \[30\] out of range"):
        build("hidden", params, "sg", out=tmp_path / "x")
    with pytest.raises(EagletError, match=r"hidden: 'url' is a required property"):
        params_for(root, "bad.yaml", backend="sglang")
    with pytest.raises(EagletError, match="not a hidden-states directory"):
        HiddenReader(tmp_path)
