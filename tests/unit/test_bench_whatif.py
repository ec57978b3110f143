"""Every ``bench.fanout --what-if`` still finds the product line it changes: a what-if whose
line moved would fail the benchmark run that asks for it, long after the change that moved it.
Applied in a child process: a what-if replaces product functions in the process it runs in."""

from __future__ import annotations

import subprocess
import sys

from bench.fanout.whatif import WHAT_IFS

_APPLY_ALL = """
import asyncio, inspect
from bench.fanout.whatif import WHAT_IFS, apply_what_ifs
apply_what_ifs(sorted(WHAT_IFS))
import workers.agent.commands as commands
# Patched: the function now comes from the recompiled source, still a coroutine function.
assert inspect.iscoroutinefunction(commands.CommandPath._finish)
print("applied", len(WHAT_IFS))
"""


def test_every_what_if_still_applies_to_the_product() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _APPLY_ALL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["applied", str(len(WHAT_IFS))]
