"""GET /api/v1/commands/unverified is paginated like /workers: keyset pages in the order of the
list (oldest issued first), the next in the ``Link`` header (it returned the whole list)."""

from __future__ import annotations

import re

import httpx

from controlplane.api.models import encode_cursor
from controlplane.coordinator.service import Coordinator
from controlplane.wire.errors import WireCode
from tests.component.conftest import AUTH, Clock, command, feed, sample
from tests.factories import nack

LINK = re.compile(r"<([^>]+)>; rel=\"next\"")


async def test_unverified_commands_come_in_pages(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    for i in range(7):  # two issued at each instant: the ids break the tie
        forged = command(f"r-forged-{i}", issued=float(i // 2))
        coordinator.fleet.observe_unverified(forged, WireCode.SIGNATURE_MISSING, "unsigned")
    feed(coordinator)
    whole = [(u.rollout_id, u.command_id) for u in coordinator.fleet.unverified()]
    assert len(whole) == 7
    pages: list[list[tuple[str, str]]] = []
    url: str | None = "/api/v1/commands/unverified?limit=3"
    while url is not None:
        answer = await client.get(url, headers=AUTH)
        assert answer.status_code == 200, answer.text
        pages.append([(u["rollout_id"], u["command_id"]) for u in answer.json()])
        found = LINK.search(answer.headers.get("Link", ""))
        url = None if found is None else found.group(1)
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [entry for page in pages for entry in page] == whole
    default = await client.get("/api/v1/commands/unverified", headers=AUTH)
    assert len(default.json()) == 7 and "Link" not in default.headers
    for bad in ("nonsense", encode_cursor("not a time", "r", "c"), encode_cursor("a", "b")):
        refused = await client.get(f"/api/v1/commands/unverified?cursor={bad}", headers=AUTH)
        assert refused.status_code == 422
        assert refused.json()["error"]["code"] == "INVALID_REQUEST"


async def test_the_coordinators_compaction_drops_the_nacks_of_expired_forgeries(
    coordinator: Coordinator, clock: Clock, client: httpx.AsyncClient
) -> None:
    """The coordinator compacts one rollout at a time (compact_stepwise), not through
    Fleet.compact: expired forgeries lose their NACKs there too, and later ones are dropped."""
    forged = command("r-forged", issued=0.0)  # expires an hour later
    coordinator.fleet.observe_unverified(forged, WireCode.SIGNATURE_MISSING, "unsigned")
    refusals = [
        nack(f"w{i}", 1, "SIGNATURE_MISSING", rollout_id="r-forged", command_id=forged.command_id)
        for i in range(3)
    ]
    feed(coordinator, *refusals)
    clock.advance(7200)
    await coordinator.compact_stepwise()
    assert coordinator.fleet.fold_state().unreadable == {}
    feed(
        coordinator,
        nack("w9", 7300, "SIGNATURE_MISSING", rollout_id="r-forged", command_id=forged.command_id),
    )
    assert coordinator.fleet.fold_state().unreadable == {}
    listed = (await client.get("/api/v1/commands/unverified", headers=AUTH)).json()
    assert [(u["rollout_id"], u["nacks"]) for u in listed] == [("r-forged", 3)]
    assert (await client.get("/api/v1/rollouts/r-forged", headers=AUTH)).status_code == 404


async def test_the_unverified_commands_held_are_a_metric(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    for i in range(3):
        forged = command(f"r-metric-{i}", issued=float(i))
        coordinator.fleet.observe_unverified(forged, WireCode.SIGNATURE_MISSING, "unsigned")
    feed(coordinator)
    metrics = (await client.get("/metrics")).text
    assert sample(metrics, "controlplane_commands_unverified") == 3
    assert sample(metrics, "controlplane_commands_unverified_dropped") == 0
