"""The partial directory a hidden-states build resumes from (no model needed)."""

import torch

from eaglet.formats.hidden_store import PartialDir, Storage


def sample(i, T=5, H=8):
    g = torch.Generator().manual_seed(i)
    return {
        "id": f"s{i}",
        "input_ids": list(range(T)),
        "loss_mask": [False, False, True, True, True][:T],
        "aux": torch.randn(T, 3, H, generator=g),
        "last": torch.randn(T, H, generator=g),
    }


def test_partial_dir_keeps_complete_shards_of_the_same_plan_only(tmp_path):
    final, st = tmp_path / "abc", Storage("bfloat16", "zstd")
    p = PartialDir(final, "plan-1")
    first = p.write_shard(0, [sample(0)], st)
    p.write_shard(1, [sample(1)], st)
    (p.path / "shard-00001.safetensors").write_bytes(b"truncated")  # size no longer matches
    again = PartialDir(final, "plan-1")
    assert list(again.done) == [0] and again.done[0] == first
    assert sorted(x.name for x in again.path.iterdir()) == ["journal.jsonl", first["name"]]
    other = PartialDir(final, "plan-2")  # another plan: start over
    assert other.done == {} and [x.name for x in other.path.iterdir()] == ["journal.jsonl"]
    other.write_shard(0, [sample(0)], st)
    out = other.finish({"format": "test"})
    assert out == final and not other.path.exists()
    assert sorted(x.name for x in final.iterdir()) == ["manifest.json", "shard-00000.safetensors"]
