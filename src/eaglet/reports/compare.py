"""`eaglet compare REV_A REV_B`: two pipeline versions side by side, per dataset and drafter.

Each revision (a git revision, or `workspace`) is exported and asked for its own keys with its
own code (`eaglet keys --json`), so a code change shows up exactly where it moves a key. Raw
files outside git (multi-GB datasets, held-out suites) come from DVC's cache when the revision
tracks them in a `.dvc` file (its own bytes), else from this workspace, and the output says
which. Numbers come from the sidecars of those keys found in this workspace; `dvc params diff`
and `dvc metrics diff` add the ledger's view when the repository uses DVC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.formats.io import read_json
from eaglet.formats.metrics import summary_of

WORKSPACE = "workspace"
# (stage, stat, label) rows shown under the keys of each dataset or drafter.
NUMBERS = [
    ("prompts", "kept", "prompts"),
    ("responses", "responses", "responses"),
    ("responses", "completion_tokens", "completion tokens"),
    ("responses", "cost", "cost (USD)"),
    ("hidden", "bytes", "hidden-state bytes"),
    ("evaluate", "acceptance_length", "acceptance length"),  # the engine's where it measured
    ("evaluate", "acceptance_length_by", "acceptance length measured by"),
]


def _git(repo: Path, *args: str) -> bytes:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True)
    if r.returncode != 0:
        raise EagletError(f"git {' '.join(args)}: {r.stderr.decode().strip().splitlines()[-1]}")
    return r.stdout


def _export(repo: Path, rev: str, into: Path) -> Path:
    """The tree of `rev` (tracked files only), extracted under `into`."""
    if rev == WORKSPACE:
        return repo
    _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    with tarfile.open(fileobj=BytesIO(_git(repo, "archive", "--format=tar", rev))) as tar:
        tar.extractall(into, filter="data")
    return into


def _raw_paths(params_file: Path) -> list[str]:
    """The dataset and suite files a params file names (relative to it), read as YAML only:
    the revision's own loader runs later, in its own code."""
    from eaglet.params import merged

    try:
        data = merged(params_file)
    except Exception:  # the revision's own `eaglet keys` reports a bad file
        return []
    paths = [d.get("path") for d in (data.get("datasets") or {}).values()]
    for d in (data.get("drafters") or {}).values():
        suites = ((d or {}).get("evaluate") or {}).get("suites") or {}
        paths += [s.get("path") for s in suites.values() if isinstance(s, dict)]
    return [p for p in paths if isinstance(p, str) and not os.path.isabs(p)]


def _dvc_cached(repo: Path, pointer: Path) -> Path | None:
    """The file a `.dvc` pointer names, in this repository's DVC cache (its md5), if there."""
    import yaml

    try:
        outs = yaml.safe_load(pointer.read_text()).get("outs") or []
        md5 = outs[0]["md5"]
    except (OSError, ValueError, AttributeError, KeyError, IndexError, TypeError):
        return None
    cached = repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    return cached if cached.is_file() else None


def borrow_raw_files(repo: Path, tree: Path, params_rel: str) -> dict[str, str]:
    """Link the raw files `rev`'s params name and its tree lacks: {path: where from}."""
    borrowed = {}
    base = Path(params_rel).parent
    for rel in _raw_paths(tree / params_rel):
        target = tree / base / rel
        if target.exists():
            continue
        pointer = target.with_name(target.name + ".dvc")
        source = _dvc_cached(repo, pointer) if pointer.is_file() else None
        where = "dvc cache"
        if source is None and (repo / base / rel).is_file():
            source, where = repo / base / rel, "workspace"
        if source is None:
            continue  # the revision's own `eaglet keys` names the missing file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve())
        borrowed[str(Path(base, rel))] = where
    return borrowed


def keys_at(repo: Path, rev: str, params_rel: str) -> dict[tuple[str, str], dict]:
    """{(stage, name): provenance and relative path} as `rev`'s own code computes them; the
    raw files borrowed from outside git under ("raw", "files")."""
    with tempfile.TemporaryDirectory(prefix="eaglet-compare-") as tmp:
        tree = _export(repo, rev, Path(tmp))
        borrowed = borrow_raw_files(repo, tree, params_rel) if tree != repo else {}
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        r = subprocess.run(
            [sys.executable, "-m", "eaglet", "keys", "--json", "--params", str(tree / params_rel)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tree,
        )
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise EagletError(f"{rev}: cannot compute keys: {last}")
    rows = {(row["stage"], row["name"]): row for row in json.loads(r.stdout)}
    return rows | {("raw", "files"): {"borrowed": borrowed}}


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _changed(a: dict | None, b: dict | None) -> list[str]:
    fa, fb = _flat((a or {}).get("params", {})), _flat((b or {}).get("params", {}))
    changes = [
        f"{k}: {fa.get(k)} -> {fb.get(k)}" for k in sorted(fa | fb) if fa.get(k) != fb.get(k)
    ]
    va, vb = (a or {}).get("code_version"), (b or {}).get("code_version")
    if a and b and va != vb:  # before declared versions: a code key, no version
        changes.append(f"code version: {va or a.get('code_key')} -> {vb or b.get('code_key')}")
    return changes


def _sidecar(root: Path, row: dict | None) -> Path | None:
    if row is None or not (root / row["sidecar"]).exists():
        return None
    return root / row["sidecar"]


def _stats(root: Path, row: dict | None) -> dict:
    sidecar = _sidecar(root, row)
    return read_json(sidecar).get("stats", {}) if sidecar else {}


def compare(repo: Path, rev_a: str, rev_b: str, params_rel: str = "params.yaml") -> list[dict]:
    """One table per dataset and drafter: keys, what changed, and the numbers of each side."""
    ka, kb = keys_at(repo, rev_a, params_rel), keys_at(repo, rev_b, params_rel)
    raw_a, raw_b = ka.pop(("raw", "files"))["borrowed"], kb.pop(("raw", "files"))["borrowed"]
    root = repo / Path(params_rel).parent  # artifacts of both sides are looked up here
    subjects = sorted({(r["kind"], r["name"]) for r in [*ka.values(), *kb.values()]})
    tables = []
    if raw_a or raw_b:  # raw files outside git: where each side's bytes came from
        rows = [
            {"row": f"{path} from", "a": raw_a.get(path, "-"), "b": raw_b.get(path, "-")}
            | {"note": "", "changed": []}
            for path in sorted(raw_a | raw_b)
        ]
        tables.append({"kind": "raw files", "name": "outside git", "rows": rows})
    for kind, name in subjects:
        rows = []
        stages = sorted({s for (s, n) in ka | kb if n == name}, key=_stage_order(ka | kb))
        for stage in stages:
            a, b = ka.get((stage, name)), kb.get((stage, name))
            key_a, key_b = (a or {}).get("key", "-"), (b or {}).get("key", "-")
            rows.append(
                {
                    "row": f"{stage} key",
                    "a": key_a,
                    "b": key_b,
                    "note": "rebuild" if key_a != key_b else "",
                    "changed": _changed(a, b),
                }
            )
        for stage, stat, label in NUMBERS:
            a, b = ka.get((stage, name)), kb.get((stage, name))
            if a is None and b is None:
                continue
            va, vb = _stats(root, a).get(stat), _stats(root, b).get(stat)
            if va is None and vb is None:
                continue
            rows.append({"row": label, "a": va, "b": vb, "note": "", "changed": []})
        ea, eb = (_sidecar(root, k.get(("evaluate", name))) for k in (ka, kb))
        rows += _suite_rows(_acceptance(ea), _acceptance(eb))
        tables.append({"kind": kind, "name": name, "rows": rows})
    return tables


def _acceptance(sidecar: Path | None) -> dict[str, object]:
    """{label: value} of an evaluation's sidecar, suite by suite in its order: eaglet's and the
    engine's acceptance length per temperature and num_steps (`natural: vLLM t=0.7, 3 steps`),
    and the prompts (`natural: prompts`)."""
    if sidecar is None:
        return {}
    stats = read_json(sidecar).get("stats", {})
    if "suites" not in stats:  # an evaluation older than suites
        return {}
    out: dict[str, object] = {}
    for suite, s in summary_of(stats, str(sidecar)).suites.items():
        out |= _lengths(suite, "eaglet", s.eaglet)  # in the sidecar's (sorted) order
        out[f"{suite}: prompts"] = s.prompts
        out |= _lengths(suite, "vLLM", s.vllm)
    return out


def _lengths(suite: str, who: str, by_temperature: dict) -> dict[str, object]:
    return {
        f"{suite}: {who} t={t:g}, {n} steps": v
        for t, by_steps in by_temperature.items()
        for n, v in by_steps.items()
    }


def _suite_rows(a: dict, b: dict) -> list[dict]:
    """Acceptance length per suite, temperature and num_steps of each side, suite by suite."""
    return [
        {"row": label, "a": a.get(label), "b": b.get(label), "note": "", "changed": []}
        for label in dict.fromkeys([*a, *b])
    ]


def _stage_order(rows: dict) -> object:
    order = list(dict.fromkeys(s for (s, _) in rows))
    return order.index


def _cell(v: object) -> str:
    if v is None:
        return "not built"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render(tables: list[dict], rev_a: str, rev_b: str, md: bool = False) -> str:
    out = []
    for t in tables:
        header = ["", rev_a, rev_b, "", "what changed"]
        body = [
            [r["row"], _cell(r["a"]), _cell(r["b"]), r["note"], "; ".join(r["changed"])]
            for r in t["rows"]
        ]
        out.append(f"## {t['kind']} {t['name']}" if md else f"{t['kind']} {t['name']}")
        if md:
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "---|" * len(header))
            out.extend("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body)
        else:
            widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
            for row in [header, *body]:
                out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        out.append("")
    return "\n".join(out)


def dvc_diffs(repo: Path, rev_a: str, rev_b: str, md: bool) -> str:
    """`dvc params diff` and `dvc metrics diff` between the revisions, if this is a DVC repo."""
    if not (repo / ".dvc").is_dir():
        return ""
    revs = [rev_a] if rev_b == WORKSPACE else [rev_a, rev_b]
    parts = []
    for what in ("params", "metrics"):
        cmd = [sys.executable, "-m", "dvc", what, "diff", *revs, *(["--md"] if md else [])]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=repo)
        lines = r.stdout.strip().splitlines()
        if r.returncode == 0 and len(lines) > (2 if md else 0):  # --md: a header with no rows
            parts.append(f"dvc {what} diff:\n{r.stdout.rstrip()}\n")
    return "\n".join(parts)
