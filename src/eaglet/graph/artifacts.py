"""Keyed artifacts on disk: what exists for every stage and name, and how it relates to params.

Every artifact `<key><ext>` has a sidecar `<key>.json` (provenance + stats), written before the
artifact itself, so an artifact with its sidecar is complete. An artifact is *current* when its
key is the one params and the installed code give now; any other is kept until `eaglet gc`.
A non-current artifact whose params slice and upstream keys equal the current ones differs only
by code: it was built by another version of eaglet (the "old copy on the remote box" case).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eaglet import locks
from eaglet.errors import AwaitedFile
from eaglet.formats.io import read_json
from eaglet.graph.keys import STAGES, Keys, lock_of

KEY_RE = re.compile(r"^[0-9a-f]{12}$")
# what an interrupted build leaves: hidden's `.<key>.partial/`, train's `.<key>.work/`, atomic
# writes' `.<key><ext>.tmp-*`, a killed build's lock `.<key><ext>.lock`; the current key's
# partial and work folders are kept (a rerun resumes from them), its temporaries and lock are
# not (no rerun reads them) unless a build of that key runs
LEFTOVER_RE = re.compile(r"^\.(?P<key>[0-9a-f]{12})[^/]*\.(?P<what>partial|work|lock|tmp-[^/]*)$")
RESUMED = ("partial", "work")
CACHE_RE = re.compile(r"^(?P<key>[0-9a-f]{12})\.cache$")  # hidden.mode hybrid's states


@dataclass
class Artifact:
    stage: str
    name: str
    key: str
    path: Path
    sidecar: Path
    # "current", "other-code" (same params, other code key), "other", "incomplete" (a sidecar
    # without its artifact), "unfinished" (what an interrupted build of another key left) or
    # "cache" (a hybrid cache of another hidden key)
    state: str
    provenance: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def size(self) -> int:
        paths = [self.sidecar] + (
            [p for p in self.path.rglob("*") if p.is_file()] if self.path.is_dir() else [self.path]
        )
        return sum(p.stat().st_size for p in paths if p.exists())


def names(keys: Keys, stage: str) -> list[str]:
    p = keys.params
    return p.datasets if STAGES[stage].kind == "dataset" else p.drafters


def scan(keys: Keys) -> list[Artifact]:
    """Every keyed artifact under the params' names, current or not, with its sidecar read."""
    found = []
    for stage, st in STAGES.items():
        for name in names(keys, stage):
            try:
                current = keys.provenance(stage, name)
            except AwaitedFile:  # no key to tell current from other: left as it is
                continue
            folder = keys.path(stage, name).parent
            if not folder.is_dir():
                continue
            for sidecar in sorted(folder.glob("*.json")):
                key = sidecar.name[: -len(".json")]
                if not KEY_RE.match(key):
                    continue
                path = folder / key if st.ext == "/" else folder / f"{key}{st.ext}"
                meta = read_json(sidecar)
                prov = meta.get("provenance", {})
                if key == current["key"]:
                    state = "current"
                elif (prov.get("params"), prov.get("upstream")) == (
                    current["params"],
                    current["upstream"],
                ):
                    state = "other-code"
                else:
                    state = "other"
                if not path.exists():
                    state = "incomplete"
                found.append(
                    Artifact(stage, name, key, path, sidecar, state, prov, meta.get("stats", {}))
                )
            found += _leftovers(stage, name, folder, current["key"])
    return found


def _leftovers(stage: str, name: str, folder: Path, current: str) -> list[Artifact]:
    """What interrupted builds left (of other keys; of the current key, what no rerun reads:
    its temporaries, also those inside the partial or work folder a rerun resumes from), and
    hybrid caches (`<key>.cache/`, beside a hidden directory) of other keys; none has a
    sidecar (the `sidecar` named is in the stage's folder, where the key's lock is)."""
    found = []
    for pattern, state in ((LEFTOVER_RE, "unfinished"), (CACHE_RE, "cache")):
        for left in sorted(folder.iterdir()):
            m = pattern.match(left.name)
            resumed = state == "cache" or (m and m["what"] in RESUMED)
            if m and (m["key"] != current or not resumed):
                nothing = left.with_name(f"{left.name}.json")
                found.append(Artifact(stage, name, m["key"], left, nothing, state))
            elif m and state == "unfinished" and left.is_dir():
                for tmp in sorted(left.rglob(".*.tmp-*")):  # a write killed half-way
                    nothing = folder / f"{tmp.name}.json"
                    found.append(Artifact(stage, name, m["key"], tmp, nothing, state))
    return found


def _lock(a: Artifact) -> Path:
    """The lock a build of `a`'s key holds (graph.keys.build), beside its sidecar."""
    ext = STAGES[a.stage].ext
    return lock_of(a.sidecar.parent / (a.key if ext == "/" else f"{a.key}{ext}"))


def _building(a: Artifact) -> bool:
    """A build of `a`'s key runs now (here, or on another host: not known to have died)."""
    who = locks.holder(_lock(a))
    return who is not None and who.alive() is not False


def gc(keys: Keys, dry_run: bool = False) -> list[Artifact]:
    """Remove every non-current artifact (the DVC cache keeps what was added) and what killed
    builds left; return them. Nothing a running build uses: each key's removal holds its
    build's lock, and a key being built is passed over."""
    doomed = [a for a in scan(keys) if a.state != "current" and not _building(a)]
    if not dry_run:
        for a in doomed:
            with contextlib.suppress(locks.Locked), locks.hold(_lock(a), "eaglet gc"):
                if a.path.is_dir():
                    shutil.rmtree(a.path)
                elif a.path.exists():
                    a.path.unlink()
                a.sidecar.unlink(missing_ok=True)
    return doomed
