"""Arguments, the run over every configuration, and the heartbeat generator's child role
(``--generator-child``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench.scale as package
from bench.common import Broker, argument_parser, envelope, mode_of, quiet_logging, run_on_broker
from bench.scale import HEARTBEAT_PERIOD_S
from bench.scale.fleet import generator_host
from bench.scale.report import derive, report, targets
from bench.scale.scenario import Scenario

#: mode -> (N, R, samples per endpoint, seconds per endpoint, cap per command)
MODES = {
    "tiny": (100, 2, 3, 5.0, 60.0),
    "quick": (1000, 5, 5, 10.0, 60.0),
    "full": (10_000, 100, 10, 60.0, 120.0),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argument_parser(package)
    p.add_argument("--quick", action="store_true", help="N = 1,000, R = 5 (< 3 minutes).")
    p.add_argument("--tiny", action="store_true", help="N = 100, R = 2; to try a change.")
    p.add_argument("--n", type=int, help="Workers (overrides the mode's).")
    p.add_argument("--rollouts", type=int, nargs="+", help="Past rollouts, one configuration each.")
    p.add_argument("--samples", type=int, help="Requests per endpoint (at least two).")
    p.add_argument("--budget-s", type=float, help="Seconds per endpoint before fewer samples.")
    p.add_argument("--cap-s", type=float, help="A command or request past this is killed.")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--generator-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mode = mode_of(args.quick, args.tiny)
    n, r, samples, budget, cap = MODES[args.mode]
    args.n = args.n or n
    args.rollouts = args.rollouts or [r]
    args.samples = max(2, args.samples or samples)
    args.budget_s = args.budget_s or budget
    args.cap_s = args.cap_s or cap
    return args


async def run(args: argparse.Namespace, broker: Broker, result: dict[str, Any]) -> None:
    levels: list[dict[str, Any]] = []
    result["levels"] = levels
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for r in args.rollouts:
            print(f"N={args.n}, R={r}", flush=True)
            try:
                level = await Scenario(args, broker.bootstrap, args.n, r, Path(tmp)).run()
            except Exception as exc:  # reported in the table; the next configuration runs
                level = {"n": args.n, "rollouts": r, "error": repr(exc)}
            level["derived"] = derive(level)
            levels.append(level)
    result["targets"] = targets(levels)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    quiet_logging()
    if args.generator_child:
        asyncio.run(generator_host(json.loads(args.generator_child)))
        return 0
    result = envelope("scale", args.mode, argv)
    result["parameters"] = {
        "n": args.n,
        "rollouts": args.rollouts,
        "heartbeat_period_s": HEARTBEAT_PERIOD_S,
        "samples": args.samples,
        "budget_s": args.budget_s,
        "cap_s": args.cap_s,
    }
    return run_on_broker(result, lambda broker: run(args, broker, result), report, args.out_dir)
