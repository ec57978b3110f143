"""Fleet fan-out: N worker agents (FakeRunner) on a private broker, against bare workers and HTTP.

For each N, on a fresh set of topics and in this order:

1. **one pair** (``floor`` in the result, its old name): the bare Kafka command/ack round trip on
   the same broker: one task publishes a pre-encoded command, a second task (its own consumer and
   producer, as a worker would) consumes it and publishes a pre-encoded ack, the first consumes
   the ack. Same client settings as the product (``controlplane.kafka.bus``: acks=all,
   idempotent, read_committed); no decoding, no journal. One pair, not N workers: no floor for a
   fleet sharing the machine's cores, only what one round trip costs here.
2. **http**: what teams script today: N tiny HTTP endpoints, one uvicorn/starlette server process
   listening on N ports (one port per "worker", so a client opens N connections as it would to N
   hosts), each POST calling ``FakeRunner.update_config`` (the same no-op the agents run). Called
   with httpx, sequentially and concurrently (``asyncio.gather``), a fresh client per fan-out.
3. **bare** (the fair floor, issue 16): N bare workers (:mod:`bench.fanout.bare`), the least a
   hand-written worker does with aiokafka: its own consumer of the commands topic and its own
   producer (the product's client settings), ``json.loads`` the command, a ``succeeded`` ack
   for the Follower, the offset commit. Same process layout as the agents, started the same way,
   the same rollouts published and followed the same way (step 4); converge, and the CPU per
   command of the bare processes over the rollouts.
4. **agents**: N ``workers.agent.loop.Agent`` with ``FakeRunner``, ``ceil(N / per_process)`` OS
   processes, each agent with its own producer, consumer and journal (nothing shared but the
   event loop). Rollouts of ``update_config`` are published pinned to the N workers; the time
   from publish to ``succeeded`` is what ``Follower`` + ``Fleet.status`` (the CLI's ``--wait``)
   shows. Per worker: command-to-ack latency (terminal ack ``sent_at`` - command ``issued_at``).
   Targets: converge and CPU per command within 1.5x the bare workers' at N=100 and N=500.
5. **idle**: CPU of the agent processes (and of the broker) over a quiet window, as % of a core.

Journals default to /dev/shm: on one machine, N agents' fsyncs (two per command, in each agent
process's thread pool) would queue on one disk, which N real hosts would not; ``--state-dir``
puts them on a disk. ``--profile`` also reports, per command, the agent's steps and its produce
requests, offset commits and fetches, and the same for the bare workers.

    .venv/bin/python -m bench.fanout --quick            # N in 1, 10, 50   (< 2 minutes)
    .venv/bin/python -m bench.fanout                    # N in 1, 10, 100, 500
    .venv/bin/python -m bench.fanout --n 100 --repeats 30 --profile
    .venv/bin/python -m bench.fanout --n 50 --no-http --what-if none --what-if no-result-beat

``--what-if NAME`` (:mod:`bench.fanout.whatif`) starts the same N agents again with one line of
product code changed in their processes: what a step costs, or what a change would save.
"""

from __future__ import annotations

OVERRIDE_KEY = "max_new_tokens"
#: The fixed judging interval of the `cli`/`cli-fixed` policies (the CLI's --wait before it
#: judged by cost, 4063a89; `adaptive` is what it does now).
JUDGE_INTERVAL_S: float = 0.1
