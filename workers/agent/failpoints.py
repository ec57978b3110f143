"""Named fault points for tests of crash safety (like fail-rs or FoundationDB's buggify).

``FLEET_FAILPOINTS="after_apply=kill,after_ack=kill"`` makes the agent SIGKILL itself there;
``journal_sync=enospc`` makes every journal sync fail as on a full disk (``OSError`` ENOSPC).
Inert unless that variable is set. No other side effects.
"""

from __future__ import annotations

import errno
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
    """Act here if the failpoint ``name`` is armed: ``kill`` (as SIGKILL would) or ``enospc``."""
    if ENV not in os.environ:  # the common case, four times a command: nothing to parse
        return
    action = _active().get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
