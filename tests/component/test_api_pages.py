"""The API's hot paths judge only what a response shows (issue 18): a page of a rollout's workers
judges that page's workers, not the rollout's every worker; the cached answers stay right.

No Kafka: a Coordinator that is never started, fed directly (fixtures in tests/component/
conftest.py). Nothing here asserts on time: what was judged, and what the answers say.
"""

from __future__ import annotations

import httpx

from controlplane.coordinator.service import Coordinator
from tests.component.conftest import Clock, command, feed, heartbeat, succeeded

# --------------------------------------------------------------------------- never seen


async def test_never_seen_follows_a_heartbeat_that_comes_alone(
    coordinator: Coordinator, clock: Clock, client: httpx.AsyncClient
) -> None:
    """A worker a rollout expects but never heard from is counted ``never_seen``; its first
    heartbeat, in a fetch with no command or ack, makes the count fall at once (the desired
    levels were settled: nothing else would judge them again)."""
    r1 = command("r1", workers=["w1", "w2"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.0), r1)
    feed(coordinator, *succeeded(r1, "w1", "w2", sent=4.0))  # w2 acked, never heartbeated
    workers = (await client.get("/api/v1/summary")).json()["workers"]
    assert (workers["known"], workers["never_seen"]) == (1, 1)

    feed(coordinator, heartbeat("w2", 9.0))  # a heartbeat alone
    workers = (await client.get("/api/v1/summary")).json()["workers"]
    assert (workers["known"], workers["never_seen"]) == (2, 0)
    listed = (await client.get("/api/v1/workers")).json()
    assert [w["worker_id"] for w in listed] == ["w1", "w2"]
    assert listed[1]["heartbeat"] is not None
