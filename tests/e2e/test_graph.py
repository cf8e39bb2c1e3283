"""The build graph's promises on a real (tiny) build: rebuild only what is stale, reproduce from a
fresh clone + `dvc pull`, compare two pipeline versions, plan on SLURM.

One project is built once per module in its own git + DVC repository, with its own copy of the
eaglet package on PYTHONPATH, so code edits can be made to it without touching the checkout.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglet.formats.io import read_jsonl
from eaglet.graph.keys import Keys
from eaglet.params import load

from ..cli import command, eaglet, environ
from ..conftest import ROOT, bump_version, tiny_params, write_params

pytestmark = pytest.mark.slow

# the jobs of the drafter `d` downstream of any dataset change
DRAFTER = {"vocab": 1, "train": 1, "evaluate": 1, "export": 2}
COPY = ["Snakefile", "rules", "profiles", "envs", "dvc.yaml", "src", "data/demo", "data/heldout"]


def run(repo: Path, *cmd: str, check: bool = True) -> str:
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "DVC_NO_ANALYTICS": "1"}
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def smk(repo: Path, *args: str) -> str:
    return run(repo, sys.executable, "-m", "snakemake", "--cores", "2", *args)


def git(repo: Path, *args: str) -> str:
    return run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", *args)


def planned(repo: Path) -> dict[str, int]:
    """{rule: job count} of a dry run."""
    out = smk(repo, "-n", "--quiet", "rules")
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            counts[parts[0]] = int(parts[1])
    return counts


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("graph")
    for rel in COPY:
        src, dst = ROOT / rel, repo / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    data = tiny_params(max_new_tokens=4)
    data["datasets"]["sg"]["max_samples"] = 3
    data["datasets"]["dolly"]["max_samples"] = 3
    data["drafters"]["d"]["evaluate"]["suites"] = {
        "natural": {"path": "data/heldout/natural.jsonl"}
    }
    write_params(repo, data)
    git(repo, "init", "-q")
    run(repo, sys.executable, "-m", "dvc", "init", "-q")
    run(repo, sys.executable, "-m", "dvc", "config", "core.analytics", "false")
    smk(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "built")
    return repo


def test_built_graph_has_nothing_to_do_and_published_metrics(repo):
    assert planned(repo) == {}
    metrics = (repo / "metrics" / "datasets.json").read_text()
    assert '"responses": 3' in metrics
    drafter = json.loads((repo / "metrics" / "d.json").read_text())
    assert drafter["acceptance_length"] >= 1
    assert drafter["suites"]["natural"]["greedy_equal"]["num_steps_2"] is True
    assert (repo / "plots" / "d" / "train.csv").read_text().startswith("step,epoch,lr,loss")


def test_report_holds_the_run_numbers(repo):
    """The page `make demo` leaves (written by publish): every tagged number equals its source
    in metrics.json or a sidecar, the plots are inline, and `eaglet report` writes the same."""
    import base64
    import re

    page = (repo / "reports" / "d.html").read_text()
    keys = Keys(load(repo / "params.yaml"))
    metrics = json.loads((keys.path("evaluate", "d") / "metrics.json").read_text())
    train = json.loads(keys.sidecar("train", "d").read_text())["stats"]
    cells = dict(re.findall(r'data-metric="([^"]+)">([^<]*)<', page))
    run = metrics["suites"]["natural"]["eaglet"]["temperature_0"]["num_steps_2"]
    assert cells["suites/natural/prompts"] == "2" and metrics["suites"]["natural"]["prompts"] == 2
    shown = float(cells["suites/natural/eaglet/temperature_0/num_steps_2/acceptance_length"])
    assert shown == round(run["acceptance_length"], 3) and shown >= 1
    assert cells["suites/natural/eaglet/temperature_0/num_steps_2/greedy_equal"] == str(
        run["greedy_equal"]
    )
    offline = metrics["offline"]["num_steps_2"]["acceptance_length"]
    assert float(cells["offline/num_steps_2/acceptance_length"]) == round(offline, 3)
    assert cells["train/steps"] == str(train["steps"])
    assert float(cells["train/final_loss"]) == round(train["final_loss"], 3)
    sg = json.loads(keys.sidecar("responses", "sg").read_text())["stats"]
    assert sg["conversations"] == 3 and sg["responses"] > 3  # a record a turn: one has two
    assert cells["data/sg/responses"] == str(sg["responses"]) and cells["data/dolly/prompts"] == "3"
    for png in ("suites.png", "acceptance.png", "loss.png"):  # inline, byte for byte
        data = (keys.path("evaluate", "d") / png).read_bytes()
        assert f'alt="{png}" src="data:image/png;base64,{base64.b64encode(data).decode()}"' in page
    assert keys.key("evaluate", "d") in page and "data/heldout/natural.jsonl" in page
    out = repo / "r.html"
    report = eaglet("report", "d", "--out", out, cwd=repo, src=repo / "src")
    assert report.stdout.strip() == str(out)
    strip = re.compile(r"page written [^<]*")  # the time it was written
    assert strip.sub("", out.read_text()) == strip.sub("", page)


def test_one_dataset_param_reruns_only_its_chain_and_reverting_reruns_nothing(repo):
    params = (repo / "params.yaml").read_text()
    data = tiny_params(max_new_tokens=4)
    data["datasets"]["sg"]["max_samples"] = 3
    data["datasets"]["dolly"].update(max_samples=3, temperature=0.5)
    write_params(repo, data)
    try:
        plan = smk(repo, "-n")
        assert planned(repo) == {"responses": 1, "hidden": 1, **DRAFTER, "all": 1}
        assert (
            "data/responses/dolly/" in plan
            and "data/responses/sg/" not in plan.split("rule all")[0]
        )
    finally:
        (repo / "params.yaml").write_text(params)
    assert planned(repo) == {}


def _edit(path: Path, new: str):
    old = path.read_text()
    path.write_text(new.format(old=old))
    return old


def test_plumbing_edits_rerun_nothing_and_a_version_bump_reruns_downstream(repo):
    stage = repo / "src" / "eaglet" / "stages" / "responses"
    gen, init = stage / "run.py", stage / "__init__.py"
    old, old_init = _edit(gen, "# a comment about the engine\n{old}\n# and another one\n"), None
    try:
        assert planned(repo) == {}
        gen.write_text(old + "\n\nRETRY_NOTE = 'plumbing: no kernel reads it'\n")
        assert planned(repo) == {}
        gen.write_text(old)
        old_init = _edit(init, "{old}")
        init.write_text(bump_version(old_init))
        # prompts are upstream of responses: they stay
        assert planned(repo) == {"responses": 2, "hidden": 2, **DRAFTER, "all": 1}
    finally:
        gen.write_text(old)
        if old_init is not None:
            init.write_text(old_init)
    assert planned(repo) == {}
    hidden = repo / "src" / "eaglet" / "stages" / "hidden" / "__init__.py"
    old_hidden = _edit(hidden, "{old}")
    hidden.write_text(bump_version(old_hidden))
    try:  # the hidden stage's version: hidden and downstream only
        assert planned(repo) == {"hidden": 2, **DRAFTER, "all": 1}
    finally:
        hidden.write_text(old_hidden)


def test_plumbing_only_commit_has_nothing_to_do(repo):
    """A version bump, a reworded dry-run report and progress line, a key-machinery refactor."""
    src = repo / "src" / "eaglet"
    edits = {
        src / "__init__.py": ('__version__ = "0.1.0"', '__version__ = "0.2.0"'),
        src / "stages/responses/preflight.py": ("requests to send", "requests that would go out"),
        src / "progress.py": ('f"ETA {', 'f"eta {'),
        src / "graph/keys.py": ("KEY_LEN = 12", "KEY_LEN: int = 12"),
        src / "engines/http.py": ("POOL_CONNECTIONS = 16", "POOL_CONNECTIONS = 32"),
    }
    olds = {path: _edit(path, "{old}") for path in edits}
    try:
        for path, (old, new) in edits.items():
            path.write_text(olds[path].replace(old, new, 1))
        assert "Nothing to be done" in smk(repo, "-n")
    finally:
        for path, old in olds.items():
            path.write_text(old)


def test_artifacts_hold_no_path_of_the_building_machine(repo):
    """Built on this machine, readable on any other: no absolute path in any artifact or sidecar
    (exports name the target by its hub id)."""
    machine = [str(repo), str(ROOT), sys.prefix, str(Path.home()), "/tmp/"]
    for top in ("data/prompts", "data/responses", "data/hidden", "models"):
        for path in (repo / top).rglob("*"):
            if path.is_file() and path.suffix in (".json", ".csv", ".jsonl"):
                text = path.read_text()
                assert not [m for m in machine if m in text], path
    vllm = Path(run(repo, *command("path", "vllm", "d")).strip())
    verifier = json.loads((vllm / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "transformers_version" not in (vllm / "config.json").read_text()


def test_deleted_checkpoint_rebuilds_byte_identical(repo):
    ckpt = Path(run(repo, *command("path", "train", "d")).strip())
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    before = {p.relative_to(ckpt): p.read_bytes() for p in files}
    sidecar = json.loads(ckpt.with_suffix(".json").read_text())
    shutil.rmtree(ckpt)
    # its consumers rerun too (Snakemake reruns what reads a rebuilt input, ancient or not)
    assert planned(repo) == {"train": 1, "evaluate": 1, "export": 2, "all": 1}
    smk(repo)
    after = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    assert sorted(after) == sorted(before) and "model.safetensors" in {str(p) for p in after}
    assert all(after[p] == before[p] for p in before)  # seeded CPU training is deterministic
    again = json.loads(ckpt.with_suffix(".json").read_text())
    assert again["provenance"] == sidecar["provenance"]
    assert again["stats"]["final_loss"] == sidecar["stats"]["final_loss"]
    assert planned(repo) == {}


def test_fresh_clone_plus_dvc_pull_is_up_to_date(repo, tmp_path):
    """`make store`'s steps (the response store's snapshot and every key added, nothing deleted
    first), then a fresh clone and `dvc pull`: nothing to do, every paid answer there."""
    remote = tmp_path / "remote"
    dvc = [sys.executable, "-m", "dvc"]
    run(repo, *dvc, "remote", "add", "-f", "-d", "store", str(remote))
    recipe = (ROOT / "Makefile").read_text().split("\nstore: setup\n")[1].split("\n\n")[0]
    assert "eaglet snapshot" in recipe and "data/store" in recipe and "gc" not in recipe
    assert run(repo, *command("snapshot")).strip() == "data/store/responses.sqlite"
    stages = ("data/prompts", "data/responses", "data/hidden", "data/store", "models")
    run(repo, *dvc, "add", "-q", *stages)
    run(repo, *dvc, "push", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "store artifacts")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    run(clone, *dvc, "pull", "-q")
    assert planned(clone) == {}
    db = sqlite3.connect(clone / "data" / "store" / "responses.sqlite")
    answers = db.execute("SELECT COUNT(*) FROM responses WHERE status = 'ok'").fetchone()[0]
    db.close()
    keys = Keys(load(clone / "params.yaml"))
    records = sum(len(list(read_jsonl(keys.path("responses", ds)))) for ds in ("sg", "dolly"))
    assert answers == records == 7  # both datasets' answers (a turn each), paid once, stored
    assert "Nothing to be done" in smk(clone, "-n")


def test_gc_keeps_current_and_status_flags_other_code(repo):
    run(repo, *command("gc"))
    gen = repo / "src" / "eaglet" / "stages" / "responses" / "__init__.py"
    old = _edit(gen, "{old}")
    gen.write_text(bump_version(old))
    try:
        out = run(repo, *command("status"))
        # the new code's responses and hidden states are stale (older keys sit beside them);
        # the drafter's stages are stale too: their keys cover the hidden keys
        assert out.count("stale") == 4 + 5 and "missing" not in out
        listing = run(repo, *command("gc", "--dry-run"))
        assert listing.count("other-code") == 2 and "data/responses/" in listing
    finally:
        gen.write_text(old)
    assert "other-code" not in run(repo, *command("gc", "--dry-run"))


def test_a_missing_heldout_suite_holds_back_its_evaluation_only(repo):
    suite = repo / "data" / "heldout" / "natural.jsonl"
    saved = suite.read_bytes()
    suite.unlink()
    try:
        plan = smk(repo, "-n")
        waits = "waits for data/heldout/natural.jsonl (drafters.d.evaluate.suites.natural.path)"
        status = run(repo, *command("status"))
        keys = run(repo, *command("keys"))
        refused = eaglet("evaluate", "d", cwd=repo, src=repo / "src")
        # the suite arrives with other bytes: the evaluation alone is built again
        suite.write_bytes(saved.replace(b"?", b"!", 1))
        assert saved != suite.read_bytes()
        again = planned(repo)
    finally:
        suite.write_bytes(saved)
    assert "Nothing to be done" in plan and "eaglet: evaluate d left out:" in plan
    row = next(r for r in status.splitlines() if " evaluate " in r)
    assert "waiting" in row and waits in row
    assert other_rows_up_to_date(status, row)
    assert waits in next(r for r in keys.splitlines() if r.startswith("evaluate "))
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1 and "natural.jsonl: no such file" in err[0]
    assert again == {"evaluate": 1, "all": 1}
    assert planned(repo) == {}


def other_rows_up_to_date(status: str, waiting: str) -> bool:
    """Every artifact row of `eaglet status` but `waiting` is up to date."""
    rows = [r for r in status.splitlines() if re.search(r"  [0-9a-f]{12}  ", r) and r != waiting]
    return bool(rows) and all("up to date" in r for r in rows)


def test_compare_two_revisions(repo):
    data = tiny_params(max_new_tokens=4)
    data["datasets"]["sg"]["max_samples"] = 3
    data["datasets"]["dolly"].update(max_samples=3, temperature=0.5)
    write_params(repo, data)
    git(repo, "commit", "-qam", "dolly at temperature 0.5")
    try:
        md = run(repo, *command("compare", "HEAD~1", "HEAD", "--md"))
        same = run(repo, *command("compare", "HEAD", "HEAD", "--md"))
        built = run(repo, *command("compare", "HEAD~1", "HEAD~1", "--md"))  # the drafter built here
    finally:
        git(repo, "reset", "-q", "--hard", "HEAD~1")
    assert "## dataset dolly" in md and "## dataset sg" in md
    dolly = md.split("## dataset dolly")[1].split("##")[0]
    assert "sampling.temperature: 0 -> 0.5" in dolly and "rebuild" in dolly
    assert "| responses | 3 | not built |" in dolly
    sg = md.split("## dataset sg")[1].split("##")[0]
    n = json.loads(Keys(load(repo / "params.yaml")).sidecar("responses", "sg").read_text())
    n = n["stats"]["responses"]  # a record a turn
    assert "rebuild" not in sg and f"| responses | {n} | {n} |" in sg
    assert "temperature" in md.split("dvc params diff:")[1]  # the ledger's view, too
    assert "dvc params diff" not in same and "rebuild" not in same  # no empty tables
    drafter = built.split("## drafter d")[1].split("##")[0]  # acceptance suite by suite
    row = next(r for r in drafter.splitlines() if r.startswith("| natural: eaglet t=0, 2 steps |"))
    a, b = (c.strip() for c in row.split("|")[2:4])
    assert a == b and float(a) >= 1


def test_compare_with_a_raw_file_outside_git(repo):
    """A dataset whose raw file is not in git (the norm for multi-GB files): its revision's keys
    come from the workspace's file, and the table says so."""
    raw = repo / "data" / "raw" / "dolly.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_bytes((ROOT / "data" / "demo" / "dolly.jsonl").read_bytes())  # the same bytes
    data = tiny_params(max_new_tokens=4)
    data["datasets"]["sg"]["max_samples"] = 3
    data["datasets"]["dolly"].update(max_samples=3, path="data/raw/dolly.jsonl")
    write_params(repo, data)
    ignore = (repo / ".gitignore").read_text()
    (repo / ".gitignore").write_text(ignore + "data/raw/\n")
    git(repo, "commit", "-qam", "dolly's raw file outside git")
    try:
        assert "data/raw" not in git(repo, "ls-files")
        md = run(repo, *command("compare", "HEAD~1", "HEAD", "--md"))
    finally:
        git(repo, "reset", "-q", "--hard", "HEAD~1")
        shutil.rmtree(repo / "data" / "raw")
    assert "| data/raw/dolly.jsonl from | - | workspace |" in md
    dolly = md.split("## dataset dolly")[1].split("##")[0]
    assert "rebuild" not in dolly  # the same bytes under another name: the same keys


def test_slurm_profile_dry_run(repo):
    out = smk(repo, "--profile", "profiles/slurm", "-n", "--forceall")
    assert "rule responses" in out and "This was a dry-run" in out


def test_a_warm_start_enters_the_key_by_its_bytes_and_is_recorded(repo, tmp_path):
    """`train.init_from` the drafter's own vLLM export: the train key follows the folder's
    bytes (a copy elsewhere keeps it, one byte more moves it), the run records what it copied,
    and `eaglet status` shows it, with the epoch `train.select` kept."""
    params = load(repo / "params.yaml")
    export = Keys(params).path("vllm", "d")
    cold_key = Keys(params).key("train", "d")
    data = yaml.safe_load((repo / "params.yaml").read_text())
    warm = copy.deepcopy(data)
    warm["drafters"]["d"]["train"]["init_from"] = os.path.relpath(export, repo)
    try:
        write_params(repo, warm)
        key = Keys(load(repo / "params.yaml")).key("train", "d")
        elsewhere = tmp_path / "drafter"
        shutil.copytree(export, elsewhere)
        warm["drafters"]["d"]["train"]["init_from"] = str(elsewhere)
        write_params(repo, warm)
        assert Keys(load(repo / "params.yaml")).key("train", "d") == key != cold_key
        with open(elsewhere / "config.json", "a") as f:
            f.write("\n")
        assert Keys(load(repo / "params.yaml")).key("train", "d") not in (key, cold_key)
        warm["drafters"]["d"]["train"]["init_from"] = os.path.relpath(export, repo)
        warm["drafters"]["d"]["train"]["select"] = {"by": "offline_acceptance", "num_steps": 2}
        write_params(repo, warm)
        run(repo, *command("train", "d"))
        trained = Keys(load(repo / "params.yaml")).path("train", "d")
        stats = json.loads(trained.parent.joinpath(f"{trained.name}.json").read_text())["stats"]
        status = run(repo, *command("status"))
    finally:
        write_params(repo, data)
    vocab = stats["init_from"]["draft_vocab"]
    assert stats["init_from"] == {
        "format": "vllm",
        "rows_copied": vocab,
        "draft_vocab": vocab,
        "source_draft_vocab": vocab,
    }
    row = next(r for r in status.splitlines() if " train " in r)
    assert f"warm start (vllm format, {vocab}/{vocab} lm_head rows)" in row
    sel = stats["selected"]
    assert sel["by"] == "offline_acceptance" and len(sel["curve"]) == 2
    kept = f"kept epoch {sel['epoch'] + 1} of 2 (offline acceptance {sel['value']:.3f}, last "
    assert kept in row
    assert planned(repo) == {}  # back to the cold params: nothing to build


def test_ddp_training_runs_under_torchrun_and_enters_the_key(tmp_path):
    for rel in COPY:
        (shutil.copytree if (ROOT / rel).is_dir() else shutil.copy)(ROOT / rel, tmp_path / rel)
    data = tiny_params()
    write_params(tmp_path, data)
    one = Keys(load(tmp_path / "params.yaml")).key("train", "d")
    env = environ(tmp_path / "src", WORLD_SIZE="2")
    mismatch = eaglet("train", "d", params=tmp_path / "params.yaml", env=env)
    assert mismatch.returncode != 0
    assert "drafters.d.train.processes is 1 but 2 processes run" in mismatch.stderr
    assert len(mismatch.stderr.strip().splitlines()) == 1

    data["drafters"]["d"]["train"].update(processes=2, device="cuda")
    write_params(tmp_path, data)
    two = Keys(load(tmp_path / "params.yaml")).key("train", "d")
    assert two != one  # the global batch doubles: another checkpoint
    train = smk(tmp_path, "-n", "-p").split("rule train:")[1].split("rule ")[0]
    assert "gpu=2" in train and f"models/d/train/{two}" in train
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m eaglet train d" in train
