"""The dress rehearsal: the user's production file, run by `snakemake` to the end.

`examples/kimi-k2.5.params.yaml` itself, extended by an overlay that swaps only what cannot
exist here: the target (a miniature Kimi-shaped model: `text_config` DeepSeek-V3 MLA + MoE,
`language_model.` prefix, sharded), the endpoints (one loopback server answering both SGLang
`/generate` and OpenRouter's chat route with the miniature's real greedy answers; the
operator's vLLM engine for hidden states, started here as the example's comment says: the
extract_hidden_states method writing to a spool, on this CPU eaglet's CPU copy of vLLM's
connector, fp32), the sizes (a few samples per dataset, short answers, a small token budget,
2 DDP processes on gloo), and one engine placement the miniature cannot take on this CPU:
evaluation, the example's vLLM TP 8, becomes the in-process decoder (`engine: none`,
`in_process: true`). vLLM's CPU build does not start EAGLE-3 on an MLA target: its CPU MLA
backend pages the KV cache in blocks of 16, the drafter's attention backend in multiples of 32,
and speculative decoding needs one size (docs/targets.md).
The raw files are written here, one per format, at the example's own paths and extensions
(.jsonl, .parquet, .json, .jsonl.gz, .jsonl.zst). Everything else is the example's: both
generation backends, B2's token budget, the dollar budget, fp8 + zstd storage, the drafter's
shape rules and 7 TTT steps, both exports.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglet.engines.vllm.hidden import PROBE_IDS
from eaglet.formats.datasets import BadRow, to_messages
from eaglet.formats.readers import iter_rows
from eaglet.graph.keys import Keys
from eaglet.model.target import load_model, load_tokenizer, resolve
from eaglet.params import load, merge_patch

from ..cli import eaglet
from ..conftest import FIXTURES, ROOT
from ..kimi_fixture import operator_engine, tiny_kimi
from ..sglang_server import SGLangServer

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # the operator's vLLM engine

EXAMPLE = ROOT / "examples" / "kimi-k2.5.params.yaml"
KEY = "sk-rehearsal"
# on GPUs vLLM's own ExampleHiddenStatesConnector; here eaglet's CPU copy of it
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "eaglet.engines.hidden_connector")
ENGINE = {"max_model_len": 257, "max_num_seqs": 2, "threads": 1}  # A1's max_length 256, + 1
DRAFTER = "kimi_k25_eagle3"


def write_raw(root: Path, params_file: Path) -> None:
    """Each dataset's raw file at the example's path, from the format fixtures' valid rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    for name, d in yaml.safe_load(params_file.read_text())["datasets"].items():
        rows = []
        for _, row, error in iter_rows(FIXTURES / "formats" / f"{d['format']}.jsonl"):
            try:
                if error is None and to_messages(row, d["format"]):
                    rows.append(row)
            except BadRow:
                continue
        path = root / d["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
        if path.name.endswith(".parquet"):  # one column type: plain-string contents only
            rows = [
                r for r in rows if all(isinstance(m["content"], str) for m in r.get("messages", []))
            ]
            pq.write_table(pa.Table.from_pylist(rows), path)
        elif path.name.endswith(".json"):
            path.write_text(json.dumps(rows))
        elif path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(lines))
        elif path.name.endswith(".zst"):
            path.write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            path.write_bytes(lines)
        assert rows, name


def overlay(gen: str, engine: str, spool: Path, base: Path = EXAMPLE) -> str:
    """The smoke overlay: target, endpoints, sizes, and the one engine swap (module doc)."""
    smaller = {ds: {"max_samples": 4} for ds in yaml.safe_load(base.read_text())["datasets"]}
    smaller["B2_opencodeinstruct"] = {"max_samples": 4, "token_budget": 12}  # stops B2 early
    smaller["A1_deepswekimi"] = {"max_samples": 4, "max_length": 256, "max_new_tokens": 8}
    data = {
        "extends": str(base),
        "target": {"model": "target", "max_length": 192, "revision": None},
        "backends": {
            "sglang": {"url": gen, "concurrency": 2, "timeout_s": 60},
            "openrouter": {
                "base_url": f"{gen}/v1",
                "model": "target",  # the name the loopback server lists
                "concurrency": 2,
                "timeout_s": 60,
            },
        },
        "generation": {"max_new_tokens": 8, "truncated": "keep"},  # 8 tokens: answers cut
        # the operator's engine here runs fp32 (vLLM's CPU reference MLA kernel)
        "hidden": {
            "url": engine,
            "spool": str(spool),
            "concurrency": 2,
            "compute_dtype": "float32",
        },
        "datasets": smaller,
        "drafters": {
            DRAFTER: {
                "draft_vocab_size": 64,
                "heldout_fraction": 0.2,
                "train": {"processes": 2, "grad_accum": 1, "epochs": 1, "device": "cpu"},
                "evaluate": {
                    "engine": "none",
                    "in_process": True,
                    "dtype": "float32",
                    "num_steps": [3],
                    "prompts": 2,
                    "max_new_tokens": 6,
                    "temperatures": [0],
                    "suites": None,  # the example's files are the user's: the held-out split
                },
            }
        },
    }
    return yaml.safe_dump(data, sort_keys=False)


def rehearse(root: Path, params_file: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENROUTER_API_KEY": KEY, "DVC_NO_ANALYTICS": "1"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--cores", "2"]
    cmd += ["--config", f"params={params_file}"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=2700)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The miniature target, its loopback generation server and the operator's vLLM engine."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rehearsal")
    target = tiny_kimi(root / "target")  # its own tokenizer class: trusted, as the example says
    spec = resolve(str(target), trust=True)
    model, tok = load_model(spec, "cpu", "float32"), load_tokenizer(spec)
    spool = root / "spool"
    spool.mkdir()
    with (
        SGLangServer(model, "generate", tokenizer=tok, api_key=KEY) as gen,
        operator_engine(spec, spool, root / "vllm.log", CPU_CONNECTOR, **ENGINE) as engine,
    ):
        yield root, gen, engine, spool


RUNBOOK = ROOT / "docs" / "production.md"
RUN = ("python3 --version", "cp ", "eaglet ", "snakemake ", ".venv/bin/snakemake ")
# the runbook's lines this test does its own way, and how
BY_THE_TEST = (
    ("git clone ", "the project: this checkout's tracked files, its .venv"),
    ("export HF_HOME=", "the miniature is a local folder"),
    ("hf download ", "the miniature, written by tests/kimi_fixture.py"),
    ("export OPENROUTER_API_KEY=", "set in every command's environment"),
    ("python -m sglang.launch_server ", "the loopback server answers as SGLang and OpenRouter"),
    ("vllm serve ", "the operator's engine runs for hidden states; serving is not rehearsed"),
    ("torchrun ", "the line before it, by hand"),
)


def prefilled(engine) -> float:
    """The prompt tokens the engine has prefilled since it started (its own counter)."""
    lines = engine.metrics().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:prompt_tokens_total"))


def runbook(text: str) -> list[str]:
    """The commands of a page's indented code blocks, in order; a deeper-indented line or one
    after a trailing backslash continues the command before it."""
    cmds: list[str] = []
    blank, block = True, False
    for line in text.splitlines():
        if line.startswith("    ") and (block or blank):
            block, body = True, line[4:]
            if cmds and (body.startswith(" ") or cmds[-1].endswith("\\")):
                cmds[-1] = cmds[-1].removesuffix("\\").rstrip() + " " + body.strip()
            else:
                cmds.append(body)
        elif line.strip():
            block = False
        blank = not line.strip()
    return cmds


def edit_params(root: Path, gen: str, engine: str, spool: Path) -> None:
    """The user's edit of the copied params.yaml: this machine's target, endpoints and sizes."""
    patch = yaml.safe_load(overlay(gen, engine, spool))
    patch.pop("extends")
    data = merge_patch(yaml.safe_load((root / "params.yaml").read_text()), patch)
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def raw_responses(root: Path, gen) -> None:
    """Answers the user already has for B2 (an earlier run's raw_responses.jsonl, OpenAI
    shape): the target's own, one prompt."""
    row = next(r for _, r, e in iter_rows(FIXTURES / "formats" / "opencodeinstruct.jsonl"))
    messages = to_messages(row, "opencodeinstruct")
    prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    answer = gen.chat({"model": "target", "messages": prompt, "max_tokens": 8})
    (root / "raw_responses.jsonl").write_text(json.dumps({"prompt": prompt, **answer}) + "\n")


def test_the_runbook_runs_as_printed(servers):
    """docs/production.md, every command in its code blocks in order, exactly as printed, in a
    project laid out as its step 0 says; the lines that start GPU servers are this test's
    servers. Then the real run's artifacts are checked against the servers' own counts."""
    root, gen, engine, spool = servers
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in tracked.stdout.decode().split("\0"):  # the clone: this checkout's files
        if name and (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix))
    write_raw(root, EXAMPLE)
    raw_responses(root, gen)
    env = {**os.environ, "OPENROUTER_API_KEY": KEY, "DVC_NO_ANALYTICS": "1"}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env['PATH']}"
    ran, hidden_runs = [], {}
    for cmd in runbook(RUNBOOK.read_text()):
        if any(cmd.startswith(p) for p, _ in BY_THE_TEST):
            continue
        assert cmd.startswith(RUN), f"docs/production.md: a command this test does not know: {cmd}"
        before = prefilled(engine)
        r = subprocess.run(
            ["bash", "-c", cmd], cwd=root, env=env, capture_output=True, text=True, timeout=1800
        )
        print(f"$ {cmd}\n{r.stdout}", end="")  # what the runbook's reader sees, shown on failure
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}{r.stderr[-6000:]}"
        ran.append(cmd)
        if "--until hidden" in cmd:  # what the engine prefilled for this run's hidden states
            hidden_runs["smoke.yaml" if "params=smoke.yaml" in cmd else "params.yaml"] = (
                prefilled(engine) - before
            )
        if cmd.startswith("cp examples/kimi-k2.5.params.yaml params.yaml"):
            edit_params(root, gen.url, engine.url, spool)
    assert any("params=smoke.yaml" in c for c in ran) and any("--until hidden" in c for c in ran)
    params = load(root / "params.yaml")
    keys = Keys(params)
    status = eaglet("status", "--json", params=root / "params.yaml", check=True)
    rows = json.loads(status.stdout)
    assert len(rows) == 8 * 3 + 5 and {r["state"] for r in rows} == {"up to date"}, rows
    # both generation backends answered, each with the miniature's own greedy tokens; prompts
    # that leave no room for an answer in their dataset's max_length were never sent
    side = {ds: json.loads(keys.sidecar("responses", ds).read_text()) for ds in params.datasets}
    a1 = side["A1_deepswekimi"]["stats"]
    assert a1["responses"] + a1["rejected"]["too_long"] == a1["prompts"] and a1["responses"] > 0
    b_sets = sum(s["stats"]["responses"] for d, s in side.items() if d.startswith("B"))
    assert gen.routes["/generate"] >= a1["responses"]
    assert gen.routes["/v1/chat/completions"] >= b_sets >= 7 * 2
    assert side["A1_deepswekimi"]["provenance"]["params"]["backend"]["kind"] == "sglang"
    assert side["B5_lima"]["provenance"]["params"]["backend"]["kind"] == "openai"
    b2 = side["B2_opencodeinstruct"]["stats"]  # 8-token answers against a 12-token budget
    assert b2["stopped_by"] == "token_budget" and b2["responses"] < b2["prompts"]
    assert all(s["stats"]["cost"] > 0 for d, s in side.items() if d.startswith("B"))
    # the B-sets' text answers written back in Kimi's grammar, read back by vLLM's parsers,
    # their count against the server's recorded; A1's are the engine's own ids
    for d, s in side.items():
        grammar_made = s["stats"]["from_grammar"]
        assert grammar_made == (0 if d == "A1_deepswekimi" else s["stats"]["responses"]), d
        assert s["stats"]["token_drift"]["records"] == s["stats"]["responses"], d
        assert s["stats"]["token_drift"]["drift"] <= 0.02, d  # the stage's default limit
        assert d == "A1_deepswekimi" or s["stats"]["round_trip"].startswith("vllm"), d
    # hidden states from the operator's engine: the smoke run's every sequence prefilled there
    # once (and one probe per dataset); the real run's samples reused from it or prefilled
    probes = len(PROBE_IDS) * len(params.datasets)  # at most one a dataset
    for name in ("smoke.yaml", "params.yaml"):
        run = load(root / name)
        run_keys = Keys(run)
        tokens = computed = 0
        for ds in run.datasets:
            manifest = json.loads((run_keys.path("hidden", ds) / "manifest.json").read_text())
            assert manifest["last"]["how"].startswith("last layer output from the engine"), ds
            n = json.loads(run_keys.sidecar("hidden", ds).read_text())["stats"]
            done = n["reused"] + n["computed"] + n["resumed"]
            assert done == len(manifest["samples"]), (name, ds, n)
            tokens += sum(s["tokens"] for s in manifest["samples"])
            computed += n["computed"]
        if name == "smoke.yaml":  # the first run: nothing to reuse
            assert computed > 0 and tokens + len(PROBE_IDS) <= hidden_runs[name] <= tokens + probes
        else:
            assert hidden_runs[name] <= (tokens + probes if computed else probes), computed
    assert not any(spool.iterdir())
    train = json.loads(keys.sidecar("train", DRAFTER).read_text())
    assert train["provenance"]["params"]["train"]["processes"] == 2
    assert train["stats"]["processes"] == 2
    for fmt in ("sglang", "vllm"):
        assert (keys.path(fmt, DRAFTER) / "config.json").is_file()
    ev = json.loads(keys.sidecar("evaluate", DRAFTER).read_text())["stats"]
    assert ev["acceptance_length"] >= 1.0 and ev["suites"]
    assert all(all(s["greedy_equal"].values()) for s in ev["suites"].values()), ev


def test_a_broken_example_fails_the_rehearsal(servers, tmp_path):
    """The example with A1's format changed to one its file is not in: the rehearsal fails at
    that dataset's prompts stage, and says so."""
    root, gen, engine, spool = servers
    broken = tmp_path / "kimi-k2.5.params.yaml"
    text = EXAMPLE.read_text()
    a1 = "deepswekimi.jsonl.zst\n    format: agent"
    assert text.count(a1) == 1
    broken.write_text(text.replace(a1, a1.replace("agent", "sharegpt")))
    write_raw(tmp_path, EXAMPLE)
    shutil.copytree(root / "target", tmp_path / "target")  # inside the project, as its own
    (tmp_path / "smoke.yaml").write_text(overlay(gen.url, engine.url, spool, broken))
    r = rehearse(tmp_path, "smoke.yaml")
    assert r.returncode != 0
    assert (
        "Error in rule prompts" in r.stdout + r.stderr and "A1_deepswekimi" in r.stdout + r.stderr
    )
