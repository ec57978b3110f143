"""Arguments, the run, and the child roles (``--coordinator-child``; the agents are
``bench.fanout``'s ``--agents-child``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench.progressive as package
from bench.common import (
    Broker,
    argument_parser,
    envelope,
    mode_of,
    quiet_logging,
    run_on_broker,
    state_dir,
)
from bench.progressive.hosts import coordinator_host
from bench.progressive.report import derive, report, targets
from bench.progressive.scenario import measure


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argument_parser(package)
    p.add_argument("--quick", action="store_true", help="20 agents, 1 round.")
    p.add_argument("--tiny", action="store_true", help="4 agents, 1 round; to try a change.")
    p.add_argument("--n", type=int, help="Agents (overrides the mode's).")
    p.add_argument("--rounds", type=int, help="Rounds of both arms (after one warm-up of each).")
    p.add_argument("--canary", type=int, default=1, help="Workers of the first wave.")
    p.add_argument(
        "--steps", nargs="+", default=["10%", "50%", "100%"], help="Cumulative wave sizes."
    )
    p.add_argument("--per-process", type=int, default=50, help="Agents per OS process.")
    p.add_argument("--heartbeat-s", type=float, default=3.0, help="Agents' heartbeat period.")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="Where agent journals go (default: a temp dir in /dev/shm).",
    )
    p.add_argument(
        "--profile", action="store_true", help="cProfile the controller's decide() calls."
    )
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--coordinator-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = mode_of(args.quick, args.tiny)
    n, rounds = {"tiny": (4, 1), "quick": (20, 1), "full": (100, 5)}[mode]
    args.mode = mode
    args.n = args.n or n
    args.rounds = args.rounds or rounds
    return args


async def run(args: argparse.Namespace, broker: Broker, result: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-progressive-") as tmp_name:
        data = await measure(broker.bootstrap, args, Path(tmp_name))
    result.update(data)
    result["summary"] = derive(data, args.n)
    result["targets"] = targets(result["summary"], args.n, len(data["waves"]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    quiet_logging()
    if args.coordinator_child:
        asyncio.run(coordinator_host(json.loads(args.coordinator_child)))
        return 0
    with state_dir(args.state_dir, "bench-progressive-state-") as args.state_dir:
        result = envelope("progressive", args.mode, argv)
        result["parameters"] = {
            "n": args.n,
            "rounds": args.rounds,
            "canary": args.canary,
            "steps": args.steps,
            "max_unavailable": None,
            "pause_s": 0,
            "bake_s": 0,
            "per_process": args.per_process,
            "heartbeat_s": args.heartbeat_s,
            "profile": args.profile,
            "state_dir": str(args.state_dir),
            "coordinator": "a child process (Coordinator with its controller, elected)",
        }
        return run_on_broker(result, lambda broker: run(args, broker, result), report, args.out_dir)
