"""Human output: a rollout known only from its acks (its command did not decode) renders."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from controlplane.render import target


def test_the_target_of_a_rollout_whose_command_no_worker_could_read() -> None:
    status = cast(Any, SimpleNamespace(target_version=None, overrides=None, kind=None))
    assert target(status) == "unreadable command"
