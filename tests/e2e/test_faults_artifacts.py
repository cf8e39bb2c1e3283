"""Damaged artifacts are never read as valid: JSON-lines artifacts cut short, with a changed byte
or without their end marker; hidden shards differing from the manifest; a hidden build whose
partial folder vanished; training on non-finite states. All on real files."""

import io
import itertools
import json
import shutil

import pytest
import torch
import zstandard

from eaglet.errors import EagletError
from eaglet.formats import hidden_store
from eaglet.formats import io as eio
from eaglet.formats.hidden_store import FORMAT, HiddenReader, PartialDir, Storage
from eaglet.formats.io import open_text, read_jsonl, write_jsonl_zst

# --- JSON-lines artifacts -----------------------------------------------------------------------


def records(n=2000):
    return [{"id": f"p{i:05d}", "text": f"record {i} " + "héllo " * (i % 7)} for i in range(n)]


@pytest.fixture
def artifact(tmp_path):
    path = tmp_path / "prompts" / "abc123.jsonl.zst"
    assert write_jsonl_zst(path, records()) == 2000
    return path


def one_line_error(path, match):
    with pytest.raises(EagletError, match=match) as e:
        list(read_jsonl(path))
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg and "rebuild" in msg
    return msg


def test_a_whole_artifact_reads_back_and_stays_plain_zstd_json_lines(artifact):
    assert list(read_jsonl(artifact)) == records()
    with open_text(artifact) as f:
        assert [json.loads(line) for line in f] == records()
    # other tools see exactly the records: the end marker is a skippable frame
    with zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(artifact.read_bytes()), read_across_frames=True
    ) as r:
        text = r.read().decode()
    assert [json.loads(line) for line in text.splitlines()] == records()
    assert zstandard.get_frame_parameters(artifact.read_bytes()).has_checksum
    # a prefix read (as generate's chunks do) works and stops early
    assert list(itertools.islice(read_jsonl(artifact), 3)) == records(3)


def test_empty_artifact_is_valid(tmp_path):
    path = tmp_path / "empty.jsonl.zst"
    assert write_jsonl_zst(path, []) == 0
    assert list(read_jsonl(path)) == []


def test_cut_short_is_an_error_not_fewer_records(artifact):
    data = artifact.read_bytes()
    artifact.write_bytes(data[:-20])
    one_line_error(artifact, "truncated: no end marker")
    # also for a caller reading a prefix only: the end is checked before the first record
    with pytest.raises(EagletError, match="no end marker"):
        next(read_jsonl(artifact))
    with pytest.raises(EagletError, match="no end marker"), open_text(artifact) as f:
        f.read()
    artifact.write_bytes(data[: len(data) // 2])
    one_line_error(artifact, "truncated: no end marker")
    artifact.write_bytes(b"")
    one_line_error(artifact, "truncated: no end marker")


def test_a_flipped_byte_is_corrupt(artifact):
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))
    one_line_error(artifact, "corrupt: zstd frame at byte 0")


def test_a_flipped_byte_in_the_record_count_is_caught(artifact):
    data = bytearray(artifact.read_bytes())
    data[-8] ^= 0x01  # the end marker's count: 2000 -> 2001
    artifact.write_bytes(bytes(data))
    one_line_error(artifact, "truncated: 2000 records where the end marker declares 2001")


def test_without_the_end_marker_or_from_an_older_eaglet(artifact, tmp_path):
    artifact.write_bytes(artifact.read_bytes()[: -eio.END_BYTES])
    one_line_error(artifact, r"no end marker \(cut short, or written by an older eaglet\)")
    old = tmp_path / "old.jsonl.zst"  # as the previous eaglet wrote them: one frame, no marker
    with open(old, "wb") as raw, zstandard.ZstdCompressor(level=10).stream_writer(raw) as w:
        for rec in records(10):
            w.write((eio.dumps(rec) + "\n").encode())
    one_line_error(old, "older eaglet")
    plain = tmp_path / "plain.jsonl"  # a plain JSON-lines file is no eaglet artifact either
    plain.write_text("".join(eio.dumps(r) + "\n" for r in records(10)))
    one_line_error(plain, "no end marker")


def test_a_missing_frame_is_a_record_count_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(eio, "FRAME_BYTES", 4096)  # many frames
    path = tmp_path / "x.jsonl.zst"
    write_jsonl_zst(path, records())
    data = path.read_bytes()
    frames, at = [], 0
    while at < len(data) - eio.END_BYTES:  # frame boundaries
        d = zstandard.ZstdDecompressor().decompressobj()
        d.decompress(data[at:])
        end = len(data) - len(d.unused_data)
        frames.append((at, end))
        at = end
    assert len(frames) > 3
    start, end = frames[1]
    path.write_bytes(data[:start] + data[end:])
    msg = one_line_error(path, "truncated: .* records where the end marker declares 2000")
    assert "1" in msg


def test_bad_json_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    body = b'{"a":1}\n{"a":\n{"a":3}\n'
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    path.write_bytes(cctx.compress(body) + eio._end_marker(3))
    one_line_error(path, "bad JSON at line 2")


def test_a_frame_without_checksum_is_refused(tmp_path):
    path = tmp_path / "nosum.jsonl.zst"
    body = b'{"a":1}\n'
    path.write_bytes(zstandard.ZstdCompressor().compress(body) + eio._end_marker(1))
    one_line_error(path, "no checksum")


def test_a_stage_reading_a_cut_artifact_fails_instead_of_reading_nothing(artifact):
    """hidden's responses() is a reader of upstream artifacts: it raises, writes nothing."""
    from types import SimpleNamespace

    from eaglet.stages.hidden.run import responses

    artifact.write_bytes(artifact.read_bytes()[:-20])
    spec, setup = SimpleNamespace(name="d"), SimpleNamespace(responses=artifact)
    with pytest.raises(EagletError, match="no end marker"):
        responses(spec, setup)


# --- hidden shards ------------------------------------------------------------------------------


def sample(i, T=6, H=8):
    g = torch.Generator().manual_seed(i)
    return {
        "id": f"s{i}",
        "input_ids": list(range(T)),
        "loss_mask": [False, False, True, True, True, True][:T],
        "aux": torch.randn(T, 3, H, generator=g),
        "last": torch.randn(T, H, generator=g),
    }


def build_hidden(final, storage=None, shards=((0, 1), (2, 3), (4,))):
    """A hidden-states directory made by the real writer (PartialDir + finish), no model."""
    storage = storage or Storage("float32", "zstd")
    partial = PartialDir(final, "plan", "rerun: eaglet hidden toy")
    entries, metas = [], []
    for index, ids in enumerate(shards):
        samples = [sample(i) for i in ids]
        entry = dict(partial.write_shard(index, samples, storage))
        entry.pop("index")
        entries.append(entry)
        metas += [{"id": s["id"], "shard": entry["name"], "tokens": 6} for s in samples]
    manifest = {
        "format": FORMAT,
        "dataset": "toy",
        "dtype": storage.dtype,
        "storage": storage.to_dict(),
        "target": {"hidden_size": 8},
        "aux_layer_ids": {"sglang": [1, 2, 3]},
        "shards": entries,
        "samples": metas,
    }
    return partial.finish(manifest)


def flip_in_shard(path, shard):
    p = path / shard
    data = bytearray(p.read_bytes())
    data[len(data) - 10] ^= 0x01  # inside the tensor data
    p.write_bytes(bytes(data))
    return p


def test_hidden_reader_reads_a_whole_directory(tmp_path):
    out = build_hidden(tmp_path / "h")
    reader = HiddenReader(out)
    got = list(reader)
    assert [s["id"] for s in got] == [f"s{i}" for i in range(5)]
    assert torch.equal(got[3]["aux"], sample(3)["aux"])
    assert torch.equal(reader.get("s4")["last"], sample(4)["last"])
    assert [t["id"] for t in reader.tokens()] == reader.ids


def test_a_flipped_byte_in_a_shard_raises_on_every_read_path(tmp_path):
    out = build_hidden(tmp_path / "h")
    shard = HiddenReader(out).manifest["shards"][1]["name"]
    p = flip_in_shard(out, shard)
    want = f"{p}: sha256 mismatch: damaged; rebuild: eaglet hidden toy"
    reader = HiddenReader(out)
    it = iter(reader)
    assert [next(it)["id"] for _ in range(2)] == ["s0", "s1"]  # shard 0 is intact
    with pytest.raises(EagletError) as e:
        next(it)
    assert str(e.value) == want
    with pytest.raises(EagletError, match="sha256 mismatch"):
        HiddenReader(out).get("s3")
    # ids only (the vocab stage): the size is checked, not the digest, which would read the
    # states too; a flipped byte in the states is caught where they are read
    assert [t["id"] for t in HiddenReader(out).tokens()] == [f"s{i}" for i in range(5)]
    assert HiddenReader(out).get("s4")["id"] == "s4"  # other shards read
    assert len(list(HiddenReader(out, verify=False))) == 5  # for a caller checking itself


def test_a_missing_or_resized_shard_is_one_line(tmp_path):
    out = build_hidden(tmp_path / "h")
    names = [e["name"] for e in HiddenReader(out).manifest["shards"]]
    (out / names[0]).unlink()
    with pytest.raises(EagletError) as e:
        list(HiddenReader(out))
    assert str(e.value) == f"{out / names[0]}: missing; rebuild: eaglet hidden toy"
    with open(out / names[2], "ab") as f:
        f.write(b"x")
    with pytest.raises(EagletError, match=r"bytes, the manifest says \d+: damaged"):
        HiddenReader(out).get("s4")
    with pytest.raises(EagletError, match=f"{names[0]}: missing"):  # ids only: size checked
        list(HiddenReader(out).tokens())


def test_each_shard_is_hashed_once_per_reader(tmp_path, monkeypatch):
    out = build_hidden(tmp_path / "h")
    hashed = []
    real = hidden_store.sha256_file
    monkeypatch.setattr(hidden_store, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    reader = HiddenReader(out)
    list(reader)
    list(reader)
    for sid in reader.ids:
        reader.get(sid)
    list(reader.tokens())
    assert sorted(hashed) == sorted(e["name"] for e in reader.manifest["shards"])


# --- a hidden build whose partial folder vanished ------------------------------------------------


def test_a_vanished_partial_folder_fails_and_publishes_nothing(tmp_path):
    final, st = tmp_path / "h", Storage("bfloat16", "zstd")
    p = PartialDir(final, "plan", "rerun: eaglet hidden toy")
    p.write_shard(0, [sample(0)], st)
    shutil.rmtree(p.path)  # a user or a cleanup deletes it mid-run
    with pytest.raises(EagletError) as e:
        p.write_shard(1, [sample(1)], st)
    msg = str(e.value)
    assert msg.startswith(f"{p.path}: the build folder vanished mid-run")
    assert msg.endswith("the build was lost; rerun: eaglet hidden toy")
    assert not p.path.exists()  # not made again
    with pytest.raises(EagletError, match="vanished mid-run"):
        p.finish({"format": "test"})
    assert not final.exists()


def test_a_partial_folder_made_again_mid_run_fails(tmp_path):
    """What a vanished folder used to become: the next shard's write made it again."""
    final, st = tmp_path / "h", Storage("bfloat16", "zstd")
    p = PartialDir(final, "plan")
    p.write_shard(0, [sample(0)], st)
    shutil.rmtree(p.path)
    p.path.mkdir()
    p._append({"plan": "plan"})
    # (replaced: another inode; where the file system reuses it, the journal tells)
    with pytest.raises(EagletError, match=r"(replaced mid-run|not in its journal).*build was lost"):
        p.finish({"format": "test"})
    assert not final.exists()


def test_a_shard_or_journal_lost_from_the_partial_folder_fails(tmp_path):
    final, st = tmp_path / "h", Storage("bfloat16", "zstd")
    p = PartialDir(final, "plan")
    first = p.write_shard(0, [sample(0)], st)
    p.write_shard(1, [sample(1)], st)
    (p.path / first["name"]).unlink()
    with pytest.raises(EagletError, match=f"{first['name']} is missing: the build was lost"):
        p.finish({"format": "test"})
    assert not final.exists()
    again = PartialDir(final, "plan")  # a rerun resumes with what is left
    assert sorted(again.done) == [1]
    again.write_shard(0, [sample(0)], st)
    (again.path / hidden_store.JOURNAL).unlink()
    with pytest.raises(EagletError, match=r"lost its journal\.jsonl"):
        again.finish({"format": "test"})
    assert not final.exists()


# --- training on non-finite states ---------------------------------------------------------------


def test_nan_states_stop_training_naming_the_step_and_sample(tmp_path):
    from ..hidden_fixture import bundle, fit_tiny

    torch.set_num_threads(2)
    data = bundle(n=8, prompt_len=6, new_tokens=8)
    victim = data["samples"][5]
    victim["aux"] = victim["aux"].clone()
    victim["aux"][4, 1, 7] = float("nan")
    out = tmp_path / "drafter"
    with pytest.raises(EagletError) as e:
        fit_tiny(data, out, batch_size=2, heldout_fraction=0.0, epochs=1, checkpoint_every=1)
    msg = str(e.value)
    assert msg.startswith("train: non-finite loss at step ")
    assert f"sample {victim['id']}: non-finite hidden states" in msg
    step = int(msg.split("at step ")[1].split()[0])
    assert 1 <= step <= 4
    assert not out.exists()  # nothing published
    # the checkpoints before it hold finite weights only
    ckpt = out.parent / f".{out.name}.work" / "checkpoint.pt"
    if step > 1:
        state = torch.load(ckpt, weights_only=False)
        assert state["step"] == step - 1
        assert all(
            torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()
        )
