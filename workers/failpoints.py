"""Named crash points for tests of crash safety (like fail-rs or FoundationDB's buggify).

``FLEET_FAILPOINTS="after_apply=kill,after_ack=kill"`` makes the agent SIGKILL itself there.
Inert unless that variable is set. No other side effects.
"""

from __future__ import annotations

import os
import signal

ENV = "FLEET_FAILPOINTS"


def _active() -> dict[str, str]:
    spec = os.environ.get(ENV, "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        out[name] = action or "kill"
    return out


def hit(name: str) -> None:
    """Crash here if the failpoint ``name`` is armed (only action: kill, as SIGKILL would)."""
    action = _active().get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
