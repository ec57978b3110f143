"""Fleet scale: N synthetic workers and R past rollouts, measured through the product's own CLI and API.

Issue 18's benchmark. For each configuration (default N = 10,000 workers, R = 100 past
rollouts), on a private broker and a fresh set of topics created by ``controlplane topics
ensure`` (so the topic settings the product chooses apply):

* a generator child process sends every worker's heartbeat (the project's ``Heartbeat``,
  labels ``model=big``) every 3 s, spread evenly over the 3 s, for the whole run;
* R past rollouts pinned to all N workers (a ``Command`` and accepted, running, succeeded acks
  per worker: 3N per rollout) and one rollout in progress (accepted and running acks) are
  produced beforehand, batched (rendered from real encoded acks: ``bench.scale.fleet``);
* the floor: a bare ``AIOKafkaConsumer`` reading every topic to its end, the least any
  replaying reader pays; the replay-bound rows are reported as a ratio to it;
* the CLI as a user runs it (``python -m controlplane ...`` subprocesses, wall time, peak RSS
  from ``wait4``, exit code): ``reload-weights --selector model=big``, ``status <id> --json``
  (the rollout in progress), ``status --json`` (all; its output bytes);
* the coordinator (``python -m controlplane coordinator``, a child process): start until
  ``/healthz`` says ready, RSS then and at the end; ``GET /api/v1/workers``,
  ``/api/v1/rollouts?limit=50``, ``/metrics`` (p50/p99, bytes), every GET path of its OpenAPI
  document naming a summary (``absent`` when none), one dashboard update
  (``probe.dashboard_paths``: the stream's snapshot and the pages of workers it shows),
  ``/healthz`` while the biggest of those responses is being built, and one rollout's 3N acks produced in a burst until the API shows it succeeded;
* a watcher polling ``/api/v1/workers?alive=true`` and the in-progress rollout's phase records
  every false verdict (fewer than N alive, the rollout shown failed).

Every command and request is capped (``--cap-s``): one that takes longer is killed and reported
so. The table shows each figure next to the issue's target and a verdict per target.

    .venv/bin/python -m bench.scale --quick                 # N = 1,000, R = 5 (< 3 minutes)
    .venv/bin/python -m bench.scale                         # N = 10,000, R = 100
    .venv/bin/python -m bench.scale --rollouts 10 100       # both configurations of the issue
"""

from __future__ import annotations

#: Every synthetic worker heartbeats once per period (as the agents do by default).
HEARTBEAT_PERIOD_S = 3.0
