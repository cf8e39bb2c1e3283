"""Claim: content keys cost little on top of plain Snakemake.

Measures `snakemake -n` (dry run) and a no-op run (`snakemake --cores 1` with everything built)
for (1) eaglet's real graph over 8 datasets and (2) a synthetic graph of 8 datasets x 200 shards
x 3 stages, each against a plain Snakemake graph with the same jobs at fixed paths, alternating
A/B in one run. The outputs are created empty from `snakemake --summary` (a no-op only needs
them to exist) and the benchmark checks that both graphs then have nothing to do.

    .venv/bin/python -m benchmarks.graph [--runs 5]
Targets: keyed / plain <= 1.2x; absolute no-op for 8 datasets < 1.5 s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATASETS = [f"ds{i}" for i in range(8)]
SHARDS = 200

PLAIN_REAL = """
configfile: "params.yaml"
DATASETS = list(config["datasets"])
DRAFTERS = list(config["drafters"])
rule all:
    input:
        expand("data/{stage}/{ds}", stage=["prompts", "responses", "hidden"], ds=DATASETS),
        expand("models/{d}/{stage}", stage=["vocab", "train", "evaluate", "sglang", "vllm"],
               d=DRAFTERS),
rule prompts:
    input: lambda wc: config["datasets"][wc.ds]["path"]
    output: "data/prompts/{ds}"
    shell: "touch {output}"
rule responses:
    input: "data/prompts/{ds}"
    output: "data/responses/{ds}"
    shell: "touch {output}"
rule hidden:
    input: "data/responses/{ds}"
    output: "data/hidden/{ds}"
    shell: "touch {output}"
rule vocab:
    input: lambda wc: expand("data/hidden/{ds}", ds=config["drafters"][wc.d]["datasets"])
    output: "models/{d}/vocab"
    shell: "touch {output}"
rule train:
    input: "models/{d}/vocab"
    output: "models/{d}/train"
    shell: "touch {output}"
rule evaluate:
    input: "models/{d}/train"
    output: "models/{d}/evaluate"
    shell: "touch {output}"
rule export:
    input: "models/{d}/train"
    output: "models/{d}/{fmt}"
    wildcard_constraints: fmt="sglang|vllm"
    shell: "touch {output}"
"""

SYNTH = """
import hashlib, json
from eaglet.graph.keys import code_version
DATASETS = {datasets!r}
SHARDS = range({shards})
KEYED = {keyed}
CODE = code_version("responses") if KEYED else ""
_memo = {{}}
def key(stage, ds, shard):
    if not KEYED:
        return "plain"
    k = (stage, ds, shard)
    if k not in _memo:
        up = key(*UP[stage], ds, shard) if stage in UP else ""
        payload = [stage, CODE, {{"temperature": 0.0, "shard": shard, "ds": ds}}, up]
        _memo[k] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    return _memo[k]
UP = {{"b": ("a",), "c": ("b",)}}
def path(stage, ds, shard):
    return f"data/{{stage}}/{{ds}}/{{shard}}/{{key(stage, ds, shard)}}.bin"
rule all:
    input: [path("c", ds, s) for ds in DATASETS for s in SHARDS]
rule a:
    output: "data/a/{{ds}}/{{shard}}/{{k}}.bin"
    shell: "touch {{output}}"
rule b:
    input: lambda wc: ancient(path("a", wc.ds, int(wc.shard)))
    output: "data/b/{{ds}}/{{shard}}/{{k}}.bin"
    shell: "touch {{output}}"
rule c:
    input: lambda wc: ancient(path("b", wc.ds, int(wc.shard)))
    output: "data/c/{{ds}}/{{shard}}/{{k}}.bin"
    shell: "touch {{output}}"
"""


def smk(folder: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "1", "all", *args]
    return subprocess.run(cmd, cwd=folder, check=True, capture_output=True, text=True)


def timed(folder: Path, *args: str) -> float:
    t = time.perf_counter()
    smk(folder, "--quiet", *args)
    return time.perf_counter() - t


def build(folder: Path) -> None:
    """Create every output of the graph empty, in its place, then check there is nothing to do.
    Outputs named without a suffix are eaglet's directory artifacts in keyed graphs."""
    summary = smk(folder, "--summary").stdout.split("output_file\t", 1)[1]
    for line in summary.splitlines()[1:]:
        out = folder / line.split("\t")[0]
        out.parent.mkdir(parents=True, exist_ok=True)
        directory = "." not in out.name and (folder / "rules").is_dir()
        out.mkdir(exist_ok=True) if directory else out.touch()
    smk(folder, "--touch")  # mtimes in job order, for the plain graphs that compare them
    plan = smk(folder, "-n")
    if "Nothing to be done" not in plan.stdout + plan.stderr:
        sys.exit(f"{folder.name}: not built after set-up:\n{plan.stdout[-2000:]}")


def real_projects(tmp: Path) -> tuple[Path, Path]:
    keyed, plain = tmp / "real-keyed", tmp / "real-plain"
    for folder in (keyed, plain):
        shutil.copytree(ROOT / "data" / "demo", folder / "data" / "demo")
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        demo = list(params["datasets"].values())
        params["datasets"] = {ds: dict(demo[i % len(demo)]) for i, ds in enumerate(DATASETS)}
        params["drafters"] = {"d": {"datasets": DATASETS}}
        (folder / "params.yaml").write_text(yaml.safe_dump(params))
    for rel in ("Snakefile", "rules", "profiles", "envs"):
        src = ROOT / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, keyed / rel)
    (plain / "Snakefile").write_text(textwrap.dedent(PLAIN_REAL))
    return keyed, plain


def synth_projects(tmp: Path) -> tuple[Path, Path]:
    out = []
    for name, keyed in (("synth-keyed", True), ("synth-plain", False)):
        folder = tmp / name
        folder.mkdir()
        text = SYNTH.format(datasets=DATASETS, shards=SHARDS, keyed=keyed)
        (folder / "Snakefile").write_text(text)
        out.append(folder)
    return out[0], out[1]


def measure(label: str, a: Path, b: Path, runs: int) -> dict:
    for folder in (a, b):
        build(folder)
    rows = {}
    for what, args in (("dry run", ("-n",)), ("no-op", ())):
        ta, tb = [], []
        for _ in range(runs):  # A B A B ...: drift hits both sides alike
            ta.append(timed(a, *args))
            tb.append(timed(b, *args))
        ratio = statistics.median(x / y for x, y in zip(ta, tb, strict=True))
        rows[what] = (statistics.median(ta), statistics.median(tb), ratio)
        print(
            f"{label:<26} {what:<8} keyed {rows[what][0]:6.2f} s   plain {rows[what][1]:6.2f} s"
            f"   keyed/plain {ratio:4.2f}x",
            flush=True,
        )
    return rows


def startup() -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--version"], check=True, capture_output=True
    )
    return time.perf_counter() - t


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"cpu pressure before: {cpu_pressure()}")
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-graph-") as tmp:
        tmp = Path(tmp)
        real = measure("real graph, 8 datasets", *real_projects(tmp), args.runs)
        measure(f"synthetic 8 x {SHARDS} x 3", *synth_projects(tmp), args.runs)
    print(f"cpu pressure after:  {cpu_pressure()}")
    noop = real["no-op"][0]
    floor = statistics.median(startup() for _ in range(args.runs))
    print(f"absolute no-op, 8 datasets: {noop:.2f} s (target < 1.5 s)")
    print(f"snakemake --version alone:  {floor:.2f} s (Snakemake's own start, the floor)")


if __name__ == "__main__":
    main()
