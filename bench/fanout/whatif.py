"""What-ifs for the agent, applied in an agent process only (``--what-if NAME``): each replaces
one line of product code, as written in :data:`WHAT_IFS`, by recompiling the function from its
source. Nothing in ``workers/`` or ``controlplane/`` is edited: a what-if measures what a change
there would save (CPU per command, converge) against the unchanged agents of the same run.

Two kinds: **proposals** (the same behaviour, cheaper plumbing) and **attributions** (a step
taken out, to measure what it costs; not changes to make: the step is a promise of the product).
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    """``old`` becomes ``new`` (both dedented to the function's body level, may span lines) in
    ``module.qualname``."""

    module: str
    qualname: str
    old: str
    new: str


@dataclass(frozen=True)
class WhatIf:
    kind: str  # "proposal", "attribution" or "control"
    says: str
    patches: tuple[Patch, ...]


WHAT_IFS: dict[str, WhatIf] = {
    "none": WhatIf(
        "control",
        "the unchanged agents again, after the others: how far two fleets of the same agents "
        "differ in one run (this machine's noise)",
        (),
    ),
    "no-progress-acks": WhatIf(
        "attribution",
        "a command done within the grace publishes its terminal ack alone (its accepted and "
        "running acks are dropped): what the two progress acks cost",
        (
            Patch(
                "workers.agent.commands",
                "CommandPath._finish",
                "held = self._outbox.take_held()",
                "held = self._outbox.take_held()[:0]",
            ),
        ),
    ),
    "no-result-beat": WhatIf(
        "attribution",
        "no heartbeat beside the terminal ack (the next periodic one reports the result): what "
        "the per-command heartbeat costs",
        (
            Patch(
                "workers.agent.commands",
                "CommandPath._finish",
                "self._heart.beat_soon()  # appended right after the acks below: one request for "
                "both",
                "pass",
            ),
        ),
    ),
    "runner-inline": WhatIf(
        "attribution",
        "the runner called on the event loop instead of in a thread (FakeRunner returns at "
        "once): what the runner's thread hop costs",
        (
            Patch(
                "workers.agent.apply",
                "apply",
                "task = asyncio.ensure_future(asyncio.to_thread(call))",
                "async def _inline() -> Any:\n"
                "    return call()\n"
                "\n"
                "task = asyncio.ensure_future(_inline())",
            ),
        ),
    ),
    "sync-on-loop": WhatIf(
        "attribution",
        "the journal's fsync on the event loop instead of in a thread (journals are in "
        "/dev/shm here): what the two thread hops per command cost",
        (
            Patch(
                "workers.agent.durable",
                "Journal._sync",
                "await asyncio.to_thread(self._state.sync)",
                "self._state.sync()",
            ),
        ),
    ),
}


def apply_what_ifs(names: list[str]) -> None:
    """Apply the named what-ifs in this process (before any agent is built)."""
    for name in names:
        for patch in WHAT_IFS[name].patches:
            _apply(patch)


def _apply(patch: Patch) -> None:
    module = importlib.import_module(patch.module)
    owner_name, _, func_name = patch.qualname.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    func = inspect.unwrap(getattr(owner, func_name))
    source = textwrap.dedent(inspect.getsource(func))
    found = _find_indented(source, patch.old)
    if found is None:
        raise RuntimeError(f"what-if: {patch.qualname} no longer reads {patch.old!r}")
    old, indent = found
    source = source.replace(old, textwrap.indent(patch.new, indent), 1)
    # Same line numbers as the file (profiles name it where it stands), same __future__ flags.
    source = "\n" * (func.__code__.co_firstlineno - 1) + source
    flags = __future__.annotations.compiler_flag
    code = compile(source, inspect.getsourcefile(func) or patch.module, "exec", flags=flags)
    namespace = dict(vars(module))
    exec(code, namespace)  # the product's own source, one line changed
    setattr(owner, func_name, namespace[func_name])


def _find_indented(source: str, text: str) -> tuple[str, str] | None:
    """``text`` as it stands in ``source`` (each line at one common indent), and that indent."""
    first = text.splitlines()[0]
    for line in source.splitlines():
        if line.strip() == first.strip():
            indent = line[: len(line) - len(line.lstrip())]
            candidate = textwrap.indent(text, indent)
            if candidate in source:
                return candidate, indent
    return None
