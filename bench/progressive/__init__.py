"""Progressive rollouts: the controller's waves against the same waves published by hand.

N worker agents (FakeRunner) in child processes (``bench.fanout``'s agent host), one
coordinator in a child process of its own (``Coordinator`` with its controller, elected leader),
on a private broker. Every round runs both arms, alternating which goes first, each rolling a
new weights version (v2, v3, ...) to every worker in the same waves (``plan_waves`` of the
strategy: canary 1, then 10%, 50%, 100%, no ``max_unavailable``, no pause, no bake):

1. **by hand** (the baseline): one plain reload command per wave (``build_command`` +
   ``publish``, explicit worker ids), the next published once every terminal ack of the wave has
   been read back. The target is retired meanwhile (its selector matches nobody), so the
   controller leaves the workers alone.
2. **controller**: the target's spec (selector on the agents, stable = the version they run),
   then a ``RolloutSpec`` with that strategy; timed from the spec's publish until the rollout's
   state ``succeeded`` is read back from the controller topic.

The same reader (a ``Follower`` in this process, folding the acks and the controller topic)
waits in both arms. The coordinator runs during both, so its CPU during the hand-published waves
is what following the fleet costs; its CPU during the controller's rollout, less that of a quiet
window of the same length right after it, is the controller's cost, reported per worker per
wave (``/ (N x waves)``, as the issue asks) and per rollout.

    .venv/bin/python -m bench.progressive --quick     # 20 agents, 1 round (< 2 minutes)
    .venv/bin/python -m bench.progressive             # 100 agents, 5 rounds
"""

from __future__ import annotations

#: The labels bench.fanout's agent host gives every agent: the target's selector.
AGENT_LABELS = {"bench": "fanout"}
#: The target's selector while the baseline runs: it matches no agent.
RETIRED = {"bench": "retired"}
TARGET = "bench"
