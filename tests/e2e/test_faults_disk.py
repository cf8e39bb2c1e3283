"""A full disk, a killed build, two builds at once: through the command line, on real files.

One small project (the embedded target, two datasets, a drafter) is built once. Each test
mounts a tmpfs over one stage's folder (which hides the reference built there) and fills it:
by its size (hidden states) or with a ballast file written while the stage runs (training,
export). The stage must stop with one line naming the path and what it kept, exit 2; after
space is freed the rerun must finish with the reference's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet import locks
from eaglet.graph.keys import Keys, lock_of
from eaglet.params import load

from ..conftest import DEMO, ROOT, tiny_params, write_params

pytestmark = pytest.mark.slow

NO_SPACE = "cannot write (No space left on device)"


def eaglet(project: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "eaglet", *args, "--params", str(project / "params.yaml")]
    return subprocess.Popen(
        cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def ok(project: Path, *args: str) -> str:
    proc = eaglet(project, *args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out


def failed(proc: subprocess.Popen) -> str:
    """The one line a failed stage ends with (after its progress lines); exit 2, no traceback."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("eaglet: error: "), err
    return last


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The project, built up to the exports; the reference bytes of hidden, train and vllm."""
    root = tmp_path_factory.mktemp("disk")
    shutil.copytree(DEMO, root / "data" / "demo")
    data = tiny_params()
    data["hidden"] = {"shard_mb": 0.05}  # a shard a sample: a build part-way keeps some
    data["drafters"]["d"]["train"] |= {"epochs": 3, "checkpoint_every": 1}
    write_params(root, data)
    for args in (
        ("prompts", "sg"),
        ("prompts", "dolly"),
        ("generate", "sg", "--quiet"),
        ("generate", "dolly", "--quiet"),
        ("hidden", "sg", "--quiet"),
        ("hidden", "dolly", "--quiet"),
        ("vocab", "d"),
        ("train", "d", "--quiet"),
        ("export", "d", "--to", "vllm"),
    ):
        ok(root, *args)
    keys = Keys(load(root / "params.yaml"))
    ref = {s: files(keys.path(s, n)) for s, n in (("hidden", "sg"), ("train", "d"), ("vllm", "d"))}
    return root, keys, ref


@pytest.fixture
def disk(built):
    """mount(folder, size): a tmpfs over a stage's folder (unmounted after the test)."""
    mounted = []

    def mount(folder: Path, size: str) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)])
        if r.returncode != 0:
            pytest.skip("mounting a tmpfs needs root (CI and the developers' machines have it)")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Write a ballast file until the filesystem is full (another process filling the disk),
    then give back `leave` bytes."""
    ballast = folder / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError:
            pass
        f.truncate(max(0, f.tell() - leave))
    return ballast


def status_row(root: Path, stage: str, name: str) -> str:
    out = ok(root, "status")
    return next(x for x in out.splitlines() if x.split()[:2] == [name, stage])


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_full_disk_during_hidden_states_keeps_its_shards_and_the_rerun_completes(built, disk):
    root, keys, ref = built
    final = keys.path("hidden", "sg")
    total = sum(len(b) for b in ref["hidden"].values())
    disk(final.parent, str(total * 2 // 5))  # room for some shards, not all
    last = failed(eaglet(root, "hidden", "sg", "--quiet"))
    partial = f"{os.path.relpath(final.parent, root)}/.{final.name}.partial"
    assert f"{NO_SPACE};" in last and "shards kept in " in last, last
    assert last.endswith("; free space, then rerun: eaglet hidden sg"), last
    kept = int(last.split(" shards kept in ")[0].rsplit(" ", 1)[1])
    assert kept >= 1 and not final.exists()
    assert f"{kept} shards built; interrupted; continue: eaglet hidden sg" in status_row(
        root, "hidden", "sg"
    )
    assert partial.split("/")[-1] in os.listdir(final.parent)
    subprocess.run(["mount", "-o", "remount,size=64m", str(final.parent)], check=True)
    ok(root, "hidden", "sg", "--quiet")
    assert files(final) == ref["hidden"]  # the kept shards and the rest: the reference's bytes
    assert "up to date" in status_row(root, "hidden", "sg")


def test_a_full_disk_during_training_keeps_the_checkpoint_and_the_rerun_resumes(built, disk):
    root, keys, ref = built
    out = keys.path("train", "d")
    folder = disk(out.parent, "512m")
    proc = eaglet(root, "train", "d", "--quiet")
    wait_for(out.parent / f".{out.name}.work" / "checkpoint.json", proc)
    ballast = fill(folder)
    last = failed(proc)
    assert f"{NO_SPACE};" in last and "the checkpoint at step " in last, last
    assert last.endswith("; free space, then rerun: eaglet train d"), last
    assert not out.exists() and not any(".tmp-" in p.name for p in out.parent.rglob("*"))
    row = status_row(root, "train", "d")  # the run ended: not taken for one that runs
    assert "checkpoint at step" in row and "interrupted; continue: eaglet train d" in row, row
    ballast.unlink()
    err = eaglet(root, "train", "d", "--quiet").communicate(timeout=600)[1]
    assert files(out) == ref["train"], err  # resumed: the reference's bytes


def test_a_killed_trainer_reads_as_stopped_and_a_second_trainer_is_refused(built, disk):
    root, keys, ref = built
    out = keys.path("train", "d")
    disk(out.parent, "512m")
    first = eaglet(root, "train", "d", "--quiet")
    wait_for(out.parent / f".{out.name}.work" / "checkpoint.json", first)
    second = failed(eaglet(root, "train", "d", "--quiet"))
    assert f"train d: another eaglet train is running (pid {first.pid} on " in second, second
    row = status_row(root, "train", "d")
    assert f"running (pid {first.pid})" in row, row
    first.send_signal(signal.SIGKILL)
    first.wait()
    row = status_row(root, "train", "d")  # at once: the process the lock names is gone
    assert f"interrupted (pid {first.pid} is gone); continue: eaglet train d" in row, row
    ok(root, "train", "d", "--quiet")
    assert files(out) == ref["train"]
    assert not lock_of(out).exists()


def test_a_full_disk_during_export_publishes_nothing_and_the_rerun_is_identical(built, disk):
    root, keys, ref = built
    out = keys.path("vllm", "d")
    folder = disk(out.parent, str(2 * sum(map(len, ref["vllm"].values())) + (4 << 20)))
    ballast = fill(folder, leave=256 << 10)  # room for the lock and config.json, not the model
    last = failed(eaglet(root, "export", "d", "--to", "vllm"))
    assert last.startswith(f"eaglet: error: {out}: {NO_SPACE}; nothing of it was published")
    assert last.endswith("; free space, then rerun: eaglet export d --to vllm"), last
    assert sorted(os.listdir(folder)) == ["ballast"]  # no temporary folder, no lock
    ballast.unlink()
    ok(root, "export", "d", "--to", "vllm")
    assert files(out) == ref["vllm"]


def test_a_read_only_folder_is_one_line_too(built, disk):
    root, keys, _ = built
    out = keys.path("vocab", "d")
    folder = disk(out.parent, "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
    last = failed(eaglet(root, "vocab", "d"))
    assert "Read-only file system" in last, last


def test_gc_removes_what_a_killed_export_left_and_nothing_published(built):
    root, keys, ref = built
    out = keys.path("vllm", "d")
    # a build of the key that runs now keeps its temporaries
    running = out.parent / f".{out.name}.tmp-running"
    with locks.hold(lock_of(out), "eaglet export d --to vllm"):
        running.mkdir()
        assert running.name not in ok(root, "gc", "--dry-run")
    running.rmdir()
    killed = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from eaglet import locks\n"
        "from eaglet.atomic import atomic_path\n"
        "from eaglet.graph.keys import lock_of\n"
        "out = Path(sys.argv[1])\n"
        "with locks.hold(lock_of(out), 'eaglet export d --to vllm'):\n"
        "    with atomic_path(out, directory=True) as tmp:\n"
        "        (tmp / 'config.json').write_text('{}')\n"
        "        os.kill(os.getpid(), 9)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", killed, str(out)], env=env)
    assert r.returncode == -signal.SIGKILL
    left = sorted(p.name for p in out.parent.iterdir() if p.name.startswith("."))
    assert len(left) == 2 and lock_of(out).name in left  # the temporary folder and the lock
    listed = ok(root, "gc", "--dry-run")
    assert all(f"{name} (unfinished" in listed for name in left), listed
    ok(root, "gc")
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []
    assert files(out) == ref["vllm"]  # the published export stays
    assert "up to date" in status_row(root, "vllm", "d")
    assert json.loads((out / "config.json").read_text())


WRITERS = """
import resource, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from eaglet.atomic import WriteFailed, atomic_path
from eaglet.formats.io import write_jsonl_zst

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
big = {"x": torch.zeros(1 << 16)}
folder = Path(sys.argv[1])
writers = {
    "safetensors": lambda tmp: save_file(big, str(tmp)),
    "torch": lambda tmp: torch.save(big, tmp),
    "jsonl": None,
}
for name, write in writers.items():
    try:
        if write is None:
            write_jsonl_zst(folder / name, ({"i": i, "r": str(i) * 50} for i in range(50000)))
        else:
            with atomic_path(folder / name) as tmp:
                write(tmp)
        print(name, "written")
    except WriteFailed as e:
        print(name, e)
"""


def test_a_file_size_limit_is_a_refused_write_for_every_writer(tmp_path):
    """RLIMIT_FSIZE (EFBIG) on safetensors', torch's and eaglet's own writers: each is one
    WriteFailed naming the file; no temporary is left."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(
        [sys.executable, "-c", WRITERS, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"safetensors {tmp_path}/safetensors: cannot write (File too large)"
    assert lines[1] == f"torch {tmp_path}/torch: cannot write (file write failed)"  # no errno
    assert lines[2] == f"jsonl {tmp_path}/jsonl: cannot write (File too large)"
    assert os.listdir(tmp_path) == []
