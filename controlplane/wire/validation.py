"""One summarizer of pydantic validation errors, for every message a user reads.

Each caller keeps its own format through the options (how many errors, clipped or not, with
the bad input or not, how a location is named). No I/O, nothing of the project.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

Location = tuple[int | str, ...]


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ``...`` marking a cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dotted(loc: Location, *, part_clip: int | None = None) -> str:
    """``a.b.0``, each part clipped to ``part_clip`` characters; ``<root>`` for the model itself."""
    parts = (str(p) if part_clip is None else clip_text(str(p), part_clip) for p in loc)
    return ".".join(parts) or "<root>"


def summarize(
    exc: ValidationError,
    *,
    limit: int = 5,
    more: bool = True,
    clip: int | None = None,
    show_input: bool = False,
    name: Callable[[Location], str] = dotted,
) -> str:
    """``loc: msg; loc: msg; ... and N more`` for the first ``limit`` errors of ``exc``.

    ``more``: say how many errors were left out. ``clip``: clip each ``loc: msg`` part.
    ``show_input``: append `` (got <input>)``. ``name``: how a location reads.
    """
    parts = []
    for error in exc.errors(include_url=False)[:limit]:
        part = f"{name(error['loc'])}: {error['msg']}"
        if show_input:
            part += f" (got {error.get('input')!r})"
        parts.append(part if clip is None else clip_text(part, clip))
    left = exc.error_count() - limit
    if more and left > 0:
        parts.append(f"... and {left} more")
    return "; ".join(parts)
