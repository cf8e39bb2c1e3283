"""Keyed artifacts on disk: what exists for every stage and name, and how it relates to params.

Every artifact `<key><ext>` has a sidecar `<key>.json` (provenance + stats), written before the
artifact itself, so an artifact with its sidecar is complete. An artifact is *current* when its
key is the one params and the installed code give now; any other is kept until `eaglet gc`.
A non-current artifact whose params slice and upstream keys equal the current ones differs only
by code: it was built by another version of eaglet (the "old copy on the remote box" case).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.errors import AwaitedFile
from eaglet.formats.io import read_json
from eaglet.graph.keys import STAGES, Keys

KEY_RE = re.compile(r"^[0-9a-f]{12}$")
# what an interrupted build leaves: hidden's `.<key>.partial/`, train's `.<key>.work/`, atomic
# writes' `.<key><ext>.tmp-*`; the current key's are kept (a rerun resumes from them)
LEFTOVER_RE = re.compile(r"^\.(?P<key>[0-9a-f]{12})[^/]*\.(partial|work|tmp-[^/]*)$")
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
    """What interrupted builds of other keys left, and hybrid caches (`<key>.cache/`, beside
    a hidden directory) of other keys; neither has a sidecar."""
    found = []
    for pattern, state in ((LEFTOVER_RE, "unfinished"), (CACHE_RE, "cache")):
        for left in sorted(folder.iterdir()):
            m = pattern.match(left.name)
            if m and m["key"] != current:
                nothing = left.with_name(f"{left.name}.json")
                found.append(Artifact(stage, name, m["key"], left, nothing, state))
    return found


def gc(keys: Keys, dry_run: bool = False) -> list[Artifact]:
    """Remove every non-current artifact (the DVC cache keeps what was added); return them."""
    doomed = [a for a in scan(keys) if a.state != "current"]
    if not dry_run:
        for a in doomed:
            if a.path.is_dir():
                shutil.rmtree(a.path)
            elif a.path.exists():
                a.path.unlink()
            a.sidecar.unlink(missing_ok=True)
    return doomed
