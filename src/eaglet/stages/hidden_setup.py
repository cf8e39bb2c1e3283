"""What reading hidden states online needs of the hidden stage's `Setup` (type hints only).

`eaglet.stages.hidden.Setup` satisfies this protocol; `hidden_online` names it so that it never
imports the hidden stage, which imports it (for `write_manifest_only`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from eaglet.model.target import TargetSpec


class Setup(Protocol):
    target: TargetSpec  # where the target's files are
    engine: dict  # the hidden-states engine's settings
    source: str  # the params file, for errors
