"""Arguments, the run over every fleet size, and the child roles (``--agents-child``,
``--bare-child``, ``--http-child``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench.fanout as package
from bench.common import (
    Broker,
    argument_parser,
    conclude,
    envelope,
    mode_of,
    quiet_logging,
    state_dir,
)
from bench.fanout import JUDGE_INTERVAL_S
from bench.fanout.hosts import agent_host, bare_host, http_host
from bench.fanout.report import report, targets
from bench.fanout.scenario import measure_level
from bench.fanout.whatif import WHAT_IFS


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argument_parser(package)
    p.add_argument("--quick", action="store_true", help="N in 1, 10, 50; fewer repeats.")
    p.add_argument("--tiny", action="store_true", help="N in 1, 3; for the CI smoke test.")
    p.add_argument("--n", type=int, nargs="+", help="Fleet sizes (overrides the mode's).")
    p.add_argument("--repeats", type=int, help="Rollouts per N (after one warm-up).")
    p.add_argument("--floor-repeats", type=int, default=None)
    p.add_argument("--http-repeats", type=int, default=None)
    p.add_argument("--per-process", type=int, default=50, help="Agents per OS process.")
    p.add_argument(
        "--agent-fetch-wait-ms",
        type=int,
        default=None,
        help="What-if: the agents' consumer fetch_max_wait_ms (default: the product's).",
    )
    p.add_argument("--heartbeat-s", type=float, default=3.0, help="Agents' heartbeat period.")
    p.add_argument("--idle-s", type=float, default=None, help="Quiet window for idle CPU.")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="Where agent journals go (default: a temp dir in /dev/shm).",
    )
    p.add_argument("--no-http", action="store_true", help="Skip the HTTP baseline.")
    p.add_argument(
        "--judge",
        choices=["cli", "every-poll", "cli-fixed", "adaptive"],
        default="adaptive",
        help="When the follower recomputes the status: at most every 100 ms ('cli', the CLI "
        "at 7c3c4c5), after every poll (the CLI before it), the same with the poll cut short, "
        "or at most every 5x the last judgement's cost ('adaptive', default: what the CLI's "
        "--wait does since it was measured here).",
    )
    p.add_argument(
        "--broker-probe",
        action="store_true",
        help="Read the broker's own metrics (JMX, attached by pid; needs a JDK's javac) and its "
        "CPU, RSS and descriptors when the agents have started, around the rollouts and the idle "
        "window: requests/s by type, fetch sessions and evictions, connections, offset commits "
        "per command; the agent processes' RSS and the consumer group count.",
    )
    p.add_argument(
        "--broker-prop",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A broker property for the run's broker (repeatable), e.g. num.io.threads=4.",
    )
    p.add_argument(
        "--fetch-session-slots",
        type=int,
        default=None,
        help="The broker's max.incremental.fetch.session.cache.slots (Kafka's default: 1000); "
        "set it below N to see what fetchers beyond the cache cost.",
    )
    p.add_argument(
        "--broker-nofile",
        type=int,
        default=None,
        help="Lower the broker's open-files limit to this once it runs (about 3 per agent are "
        "needed): what happens past it. A size that fails is reported and the run goes on.",
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=600.0,
        help="How long the agents of one size may take to start (and to all heartbeat, at most "
        "120 s of it) before that size is reported failed.",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the agents at the largest N.")
    p.add_argument("--profile-rollouts", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--no-bare",
        action="store_true",
        help="Skip the bare workers (the fair floor: N hand-written aiokafka workers).",
    )
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        choices=sorted(WHAT_IFS),
        help="After the agents, the same N agents again with one line of product code changed "
        "in their processes (bench/fanout/whatif.py; repeatable): CPU per command and converge "
        "against the unchanged agents of the same run. 'none' changes nothing (the noise).",
    )
    p.add_argument("--agents-child", help=argparse.SUPPRESS)
    p.add_argument("--bare-child", help=argparse.SUPPRESS)
    p.add_argument("--http-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = mode_of(args.quick, args.tiny)
    defaults = {
        "tiny": ([1, 3], 3, 5, 2, 1.0),
        "quick": ([1, 10, 50], 8, 20, 3, 5.0),
        "full": ([1, 10, 100, 500], 20, 50, 5, 20.0),
    }[mode]
    args.mode = mode
    args.n = args.n or defaults[0]
    args.repeats = args.repeats or defaults[1]
    args.floor_repeats = args.floor_repeats or defaults[2]
    args.http_repeats = args.http_repeats or defaults[3]
    args.idle_s = args.idle_s if args.idle_s is not None else defaults[4]
    args.broker_props = {}
    for item in args.broker_prop:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--broker-prop wants KEY=VALUE, got {item!r}")
        args.broker_props[key.strip()] = value.strip()
    if args.fetch_session_slots is not None:
        args.broker_props["max.incremental.fetch.session.cache.slots"] = str(
            args.fetch_session_slots
        )
    return args


async def run(args: argparse.Namespace, broker: Broker, result: dict[str, Any]) -> None:
    if args.broker_nofile is not None and broker.pid is not None:
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (args.broker_nofile,) * 2)
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp_name:
        tmp = Path(tmp_name)
        if args.out_dir is not None:  # the children's logs are kept beside the results
            tmp = args.out_dir / f"fanout-logs-{time.strftime('%Y%m%d-%H%M%S')}"
            tmp.mkdir(parents=True, exist_ok=True)
        levels, failed = [], []
        for n in args.n:
            try:
                levels.append(await measure_level(broker.bootstrap, broker.pid, n, args, tmp))
            except (RuntimeError, TimeoutError) as exc:  # a fleet this broker did not take
                print(f"== N={n} failed: {exc!r}", flush=True)
                failed.append({"n": n, "error": repr(exc)})
    result["levels"] = levels
    result["failed_levels"] = failed
    result["targets"] = targets(levels) if levels else []
    log = broker.broker.log_file.read_text(errors="replace")
    result["broker_log"] = {
        "too_many_open_files": log.count("Too many open files"),
        "shut_down_all_log_dirs_failed": log.count("Shutdown broker because all log dirs"),
        "lines": len(log.splitlines()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    quiet_logging()
    if args.agents_child:
        asyncio.run(agent_host(json.loads(args.agents_child)))
        return 0
    if args.bare_child:
        asyncio.run(bare_host(json.loads(args.bare_child)))
        return 0
    if args.http_child:
        asyncio.run(http_host(json.loads(args.http_child)))
        return 0
    with state_dir(args.state_dir, "bench-fanout-state-") as args.state_dir:
        result = envelope("fanout", args.mode, argv)
        result["parameters"] = {
            "n": args.n,
            "repeats": args.repeats,
            "floor_repeats": args.floor_repeats,
            "http_repeats": args.http_repeats,
            "per_process": args.per_process,
            "heartbeat_s": args.heartbeat_s,
            "idle_s": args.idle_s,
            "state_dir": str(args.state_dir),
            "agent_fetch_wait_ms": args.agent_fetch_wait_ms,
            "judge": args.judge,
            "what_ifs": args.what_if,
            "judge_interval_s": JUDGE_INTERVAL_S,
            "broker_props": args.broker_props,
            "broker_nofile": args.broker_nofile,
        }
        return _run_on_broker(args, result)


def _run_on_broker(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """``bench.common.run_on_broker`` with ``--broker-prop``/``--fetch-session-slots`` set on
    the run's broker (its config is read when it starts)."""
    started = time.perf_counter()
    broker = Broker()
    broker.broker.config.overrides.update(args.broker_props)
    with broker:
        result["broker"] = {"bootstrap": broker.bootstrap, "start_s": broker.start_s}
        print(f"broker up at {broker.bootstrap} in {broker.start_s:.1f} s", flush=True)
        asyncio.run(run(args, broker, result))
    return conclude(result, report(result), args.out_dir, started)
