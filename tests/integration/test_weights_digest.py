"""The weights digest in heartbeats and the coordinator's agreement per target, on the real broker
(issue 13): two in-process agents on the torch runner, and a coordinator (no controller) whose
API shows the target. After a reload both heartbeats carry the ack's digest and the target shows
one group; a worker given other weights under the same version label makes it disagree, and
after a restart it reports the digest of what its journal restored."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ProtocolError
from controlplane.wire.protocol import (
    AckState,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    decode_heartbeat,
)
from tests.factories import agent_running, agent_settings
from tests.fleet import Tail, acks_tail, has_terminal, make_command, publish, terminal
from tests.integration.test_coordinator_api import until

pytestmark = pytest.mark.kafka

TOKEN = "integration-token"
TINY = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq": 16}
TARGET = "/api/v1/targets/tiny"


def heartbeat_or_none(value: bytes) -> Heartbeat | None:
    """A heartbeat; None for the other records of the workers topic (a coordinator's probes)."""
    try:
        return decode_heartbeat(value)
    except ProtocolError:
        return None


def beats_at(worker: str, digest: str) -> Callable[[list[Heartbeat | None]], bool]:
    """A predicate on the records read so far: ``worker``'s latest heartbeat carries ``digest``."""

    def check(items: list[Heartbeat | None]) -> bool:
        mine = [h for h in items if h is not None and h.worker_id == worker]
        return bool(mine) and mine[-1].weights_digest == digest

    return check


async def test_heartbeats_carry_the_digest_and_the_target_flags_a_worker_that_differs(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    from workers.demo.checkpoints import write_checkpoint
    from workers.runners.torch_runner import TorchRunner

    root = tmp_path / "ckpts"
    root.mkdir()
    seed1 = write_checkpoint(root / "seed1", model_kwargs=TINY, seed=1)
    seed2 = write_checkpoint(root / "seed2", model_kwargs=TINY, seed=2)
    settings = CoordinatorSettings(kafka=kafka, api_token=SecretStr(TOKEN), controller=False)
    coordinator = Coordinator(settings)
    async with contextlib.AsyncExitStack() as stack:
        runners = {w: TorchRunner({"model_kwargs": TINY, "seed": 0}) for w in ("t1", "t2")}
        agents = {
            w: agent_settings(kafka, tmp_path, worker_id=w, state_dir=tmp_path / w) for w in runners
        }
        t2_run = contextlib.AsyncExitStack()  # t2 is restarted below
        stack.push_async_callback(t2_run.aclose)
        for worker, runner in runners.items():
            stack.callback(runner.close)
            runner.load()
            running = agent_running(agents[worker], runner)
            await (t2_run if worker == "t2" else stack).enter_async_context(running)
        tail = Tail(kafka, kafka.topics.workers.name, heartbeat_or_none)
        beats = await stack.enter_async_context(tail)
        # Seeded weights are known from load on: their digest is in the heartbeats already.
        seeded = runners["t1"].describe().extra["weights_digest"]
        assert isinstance(seeded, str)
        await beats.until(beats_at("t1", seeded))

        await stack.enter_async_context(coordinator)
        await coordinator.wait_ready(60)
        api = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(coordinator)),
                base_url="http://coordinator",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        )
        put = await api.put(TARGET, json={"selector": {"model": "tiny"}})
        assert put.status_code == 201, put.text

        acks = await stack.enter_async_context(acks_tail(kafka))
        command = make_command(ReloadWeightsSpec(path=str(seed1), version="v2"))
        await publish(kafka, command)
        await acks.until(has_terminal(command.command_id, 2))
        done = terminal(acks.items, command.command_id)
        assert [a.state for a in done] == [AckState.SUCCEEDED] * 2
        digest = done[0].result["weights_digest"]
        assert isinstance(digest, str) and digest != seeded
        assert done[1].result["weights_digest"] == digest
        # Both workers' heartbeats now carry the digest their ack reported.
        await beats.until(
            lambda items: beats_at("t1", digest)(items) and beats_at("t2", digest)(items)
        )

        tiny = await until(
            api, TARGET, lambda b: b["digests"] and b["digests"][0]["digest"] == digest
        )
        assert tiny["digests"] == [
            {"version": "v2", "digest": digest, "workers": 2, "worker_ids": ["t1", "t2"]}
        ]
        assert tiny["digests_disagree"] == 0
        assert {m["worker_id"]: m["weights_digest"] for m in tiny["members"]} == {
            "t1": digest,
            "t2": digest,
        }

        # t2 alone gets other weights under the same version label: the target disagrees.
        other = make_command(
            ReloadWeightsSpec(path=str(seed2), version="v2"), selector=Selector(worker_ids=["t2"])
        )
        await publish(kafka, other)
        await acks.until(has_terminal(other.command_id))
        (ack,) = terminal(acks.items, other.command_id)
        assert ack.state is AckState.SUCCEEDED, ack.error
        differs = ack.result["weights_digest"]
        assert isinstance(differs, str) and differs != digest
        await beats.until(beats_at("t2", differs))
        tiny = await until(api, TARGET, lambda b: b["digests_disagree"] == 1)
        assert tiny["digests"] == [
            {"version": "v2", "digest": d, "workers": 1, "worker_ids": [w]}
            for d, w in sorted([(digest, "t1"), (differs, "t2")])
        ]

        # t2 restarts on a fresh model (seed 0): what its journal restores is what it reports.
        await t2_run.aclose()
        stopped = [h for h in beats.items if h is not None and h.worker_id == "t2"][-1]
        fresh = TorchRunner({"model_kwargs": TINY, "seed": 0})
        stack.callback(fresh.close)
        await stack.enter_async_context(agent_running(agents["t2"], fresh))

        def restarted(items: list[Heartbeat | None]) -> bool:
            mine = [h for h in items if h is not None and h.worker_id == "t2"]
            return mine[-1].incarnation > stopped.incarnation and beats_at("t2", differs)(items)

        await beats.until(restarted)
        tiny = await until(api, TARGET, lambda b: b["workers"] == 2 and b["digests_disagree"] == 1)
        assert [g["digest"] for g in tiny["digests"] if g["worker_ids"] == ["t2"]] == [differs]
