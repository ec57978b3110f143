"""Arguments and the run (see the package's docstring)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import bench.drain as package
from bench.common import argument_parser, conclude, envelope, mode_of, quiet_logging
from bench.drain import engines
from bench.drain.report import derive, report, targets
from bench.drain.scenario import POLICIES, measure

#: mode -> (rounds, clients, new tokens, TinyLM d_model, n_layers); vLLM: its own below.
TORCH = {"tiny": (1, 2, 8, 64, 2), "quick": (3, 4, 16, 64, 2), "full": (10, 4, 16, 256, 4)}
#: mode -> (rounds, clients, new tokens, shapes)
VLLM = {
    "tiny": (1, 2, 8, ("vllm-in-process",)),
    "quick": (2, 2, 8, ("vllm-in-process",)),
    "full": (10, 4, 16, engines.VLLM_ENGINES),
}
#: mode -> (clients, new tokens) of the sidecar: vLLM generates 16 tokens in ~35 ms, well under
#: a streamed request's HTTP round trips, so with the in-process load a reload's pause found the
#: overlapping requests already generated; 128 tokens keep them in vLLM (docs/benchmarks.md).
SIDECAR = {"tiny": (2, 8), "quick": (2, 16), "full": (4, 128)}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argument_parser(package)
    p.add_argument("--quick", action="store_true", help="CI size: seconds (torch), ~1 min (vLLM).")
    p.add_argument("--tiny", action="store_true", help="One round; to try a change.")
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="torch (in .venv) or vllm (in .venv-vllm: in process; full mode adds the sidecar).",
    )
    p.add_argument("--shapes", nargs="+", choices=engines.VLLM_ENGINES, help="vLLM shapes.")
    p.add_argument("--rounds", type=int, help="Rounds: an idle reload, then one per policy.")
    p.add_argument("--clients", type=int, help="Concurrent requests kept going.")
    p.add_argument("--new-tokens", type=int, help="Tokens generated per request.")
    p.add_argument("--sidecar-clients", type=int, help="vLLM sidecar: --clients for it.")
    p.add_argument("--sidecar-new-tokens", type=int, help="vLLM sidecar: --new-tokens for it.")
    p.add_argument("--modes", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--d-model", type=int, help="torch: TinyLM width.")
    p.add_argument("--n-layers", type=int, help="torch: TinyLM layers.")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.mode = mode_of(args.quick, args.tiny)
    if args.engine == "torch":
        rounds, clients, tokens, d_model, n_layers = TORCH[args.mode]
        args.d_model = args.d_model or d_model
        args.n_layers = args.n_layers or n_layers
        args.shapes = ["torch"]
    else:
        rounds, clients, tokens, shapes = VLLM[args.mode]
        args.shapes = args.shapes or list(shapes)
    args.rounds = args.rounds or rounds
    args.clients = args.clients or clients
    args.new_tokens = args.new_tokens or tokens
    sidecar_clients, sidecar_tokens = SIDECAR[args.mode]
    args.sidecar_clients = args.sidecar_clients or sidecar_clients
    args.sidecar_new_tokens = args.sidecar_new_tokens or sidecar_tokens
    return args


def load_of(shape: str, args: argparse.Namespace) -> tuple[int, int]:
    """(clients, new tokens) of ``shape``."""
    if shape == "vllm-sidecar":
        return args.sidecar_clients, args.sidecar_new_tokens
    return args.clients, args.new_tokens


@contextlib.contextmanager
def open_engine(shape: str, args: argparse.Namespace, work: Path) -> Iterator[engines.Engine]:
    if shape == "torch":
        kwargs = {"d_model": args.d_model, "n_layers": args.n_layers}
        with engines.torch_engine(work / "torch", kwargs, args.new_tokens) as engine:
            yield engine
        return
    ckpts = engines.tiny_llamas(work / shape)
    if shape == "vllm-in-process":
        with engines.vllm_in_process(ckpts, args.new_tokens) as engine:
            yield engine
    else:
        with engines.vllm_sidecar(ckpts, load_of(shape, args)[1], work) as engine:
            yield engine


def _stored(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the result file keeps it: per-token gaps and latencies are summarized."""
    return {
        k: v
        for k, v in run.items()
        if k not in ("normal_gaps_s", "latencies_s", "queued_latencies_s")
    }


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    quiet_logging()
    if args.engine == "vllm":
        engines.vllm_environment()  # before vllm is imported
    started = time.perf_counter()
    result = envelope("drain", args.mode, argv)
    result["parameters"] = {
        "engine": args.engine, "shapes": args.shapes, "rounds": args.rounds,
        "clients": args.clients, "new_tokens": args.new_tokens, "modes": args.modes,
        "d_model": args.d_model, "n_layers": args.n_layers,
    }  # fmt: skip
    if "vllm-sidecar" in args.shapes:
        result["parameters"] |= {"sidecar_clients": args.sidecar_clients,
                                 "sidecar_new_tokens": args.sidecar_new_tokens}  # fmt: skip
    result["engines"] = []
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        for shape in args.shapes:
            print(f"{shape}: starting", flush=True)
            setup = time.perf_counter()
            with open_engine(shape, args, Path(tmp)) as engine:
                print(f"{shape}: ready in {time.perf_counter() - setup:.1f} s", flush=True)
                clients = load_of(shape, args)[0]
                runs = measure(engine, args.rounds, clients, args.modes)
                result["engines"].append({
                    "engine": engine.name, "ticks": engine.ticks, "clients": clients,
                    "facts": engine.facts, "setup_s": time.perf_counter() - setup,
                    "modes": derive(runs), "runs": [_stored(r) for r in runs],
                })  # fmt: skip
    result["targets"] = targets(result["engines"])
    return conclude(result, report(result), args.out_dir, started)
