"""Honest progress for long stages: count, failures, rate, tokens/s, ETA and dollars.

A rich live bar on a terminal; plain periodic lines on stderr with `--quiet` or without a TTY;
and, for other processes (`eaglet status` while Snakemake runs the stage quietly), a beacon: the
numbers as JSON in the build's working folder, rewritten every few seconds, gone when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

LOG_EVERY_S = 10.0
BEACON_EVERY_S = 2.0
BEACON = "progress.json"  # in a build's working folder (`.<key>.partial/`, `.<key>.work/`)


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Counts done/failed items, tokens and cost; renders to a TTY or logs lines.

    `total` may be revised while running (e.g. when a budget will stop the work early)."""

    def __init__(
        self,
        label: str,
        total: int,
        quiet: bool = False,
        unit: str = "req",
        beacon: Path | None = None,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.done = self.failed = self.tokens = 0
        self.base = 0  # done before this process started (a resumed build): not in the rate
        self.cost = 0.0
        self.extra: dict = {}  # what a stage adds to its beacon (training's loss)
        self.start = self._last_log = time.monotonic()
        self.beacon, self._last_beacon = beacon, float("-inf")
        self._live = None
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[line]}"),
                transient=False,
            )
            self._task = self._live.add_task(label, total=total, line="")
            self._live.start()

    def update(self, n: int = 1, tokens: int = 0, cost: float | None = None, failed: int = 0):
        self.done += n
        self.failed += failed
        self.tokens += tokens
        self.cost += cost or 0.0
        now = time.monotonic()
        if self._live is not None:
            self._live.update(self._task, completed=self.done, total=self.total, line=self.line())
        elif now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            print(f"{self.label}: {self.line()}", file=sys.stderr, flush=True)
        if self.beacon is not None and now - self._last_beacon >= BEACON_EVERY_S:
            self._last_beacon = now
            self._signal()

    def note(self, **fields) -> None:
        """Numbers of the stage's own for the beacon (e.g. loss=2.31)."""
        self.extra.update(fields)

    def _signal(self) -> None:
        from eaglet.formats.io import write_json

        if self.beacon is not None and self.beacon.parent.is_dir():  # its folder: the build's
            beat = {**self.snapshot(), "unit": self.unit, "label": self.label, **self.extra}
            with contextlib.suppress(OSError):  # a beacon never stops the work it reports
                write_json(self.beacon, beat)

    def snapshot(self) -> dict:
        """The numbers behind the line, for other processes (`eaglet status`)."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (self.done - self.base) / elapsed
        left = max(self.total - self.done, 0)
        return {
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "tokens": self.tokens,
            "cost": self.cost,
            "elapsed_s": round(elapsed, 3),
            "rate": rate,
            "tok_s": self.tokens / elapsed,
            "eta_s": left / rate if rate > 0 else None,
        }

    def line(self) -> str:
        s = self.snapshot()
        eta = s["eta_s"] if s["eta_s"] is not None else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        parts = [
            f"{self.done}/{self.total} ({pct:.0f}%)",
            f"{s['rate']:.2f} {self.unit}/s",
            f"{s['tok_s']:.0f} tok/s",
            f"ETA {_duration(eta)}",
        ]
        if self.failed:
            parts.insert(1, f"{self.failed} failed")
        if self.cost:
            projected = self.cost / self.done * self.total if self.done else 0.0
            parts.append(f"${self.cost:.4f} (projected ${projected:.4f})")
        return "  ".join(parts)

    def close(self) -> None:
        if self.beacon is not None:
            self.beacon.unlink(missing_ok=True)  # before the folder becomes the artifact
        if self._live is not None:
            self._live.stop()
        print(f"{self.label}: done {self.line()}", file=sys.stderr, flush=True)
