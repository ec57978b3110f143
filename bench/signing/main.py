"""Measures verify vs decode per signed command (see the package's docstring)."""

from __future__ import annotations

import base64
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bench.signing as package
from bench.common import argument_parser, conclude, envelope, fmt, mode_of, ratio, table
from controlplane.wire.protocol import (
    Command,
    Selector,
    UpdateConfigSpec,
    decode_command,
    encode,
    utcnow,
)
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    Verifier,
    canonical_json,
    public_key_text,
    wire_object,
)
from workers.agent.trust import TrustGate

#: A check of one command under this many microseconds meets the target.
TARGET_US = 1000.0


def _command(selector: Selector) -> Command:
    now = utcnow()
    return Command(
        command_id="r-bench.c-0123456789ab",
        rollout_id="r-bench",
        issued_at=now,
        expires_at=now + timedelta(hours=1),
        issuer="bench@cli",
        selector=selector,
        spec=UpdateConfigSpec(overrides={"max_new_tokens": 8, "temperature": 0.0}),
    )


def _per_call_us(fn: Callable[[], object], n: int, passes: int) -> float:
    """Best of ``passes`` of ``n`` calls, in microseconds a call."""
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def measure_case(name: str, selector: Selector, n: int, passes: int) -> dict[str, Any]:
    signer = Signer(Ed25519PrivateKey.generate(), "bench")
    key = TrustedKey(public_key=public_key_text(signer.key.public_key()), scope=KeyScope())
    gate = TrustGate(Verifier(TrustStore(keys={"bench": key})), [Path("/models")])
    command = _command(selector)
    data = encode(signer.sign(command))
    decoded = decode_command(data)
    obj = wire_object(data)
    canonical = canonical_json(obj)
    assert decoded.signature is not None  # signed just above
    signature = base64.b64decode(decoded.signature.value)
    public = signer.key.public_key()
    gate.admit(decoded, data)  # it verifies, before it is timed
    steps: dict[str, Callable[[], object]] = {
        "decode": lambda: decode_command(data),
        "verify": lambda: gate.admit(decoded, data),
        "json_object": lambda: wire_object(data),
        "canonical": lambda: canonical_json(obj),
        "ed25519": lambda: public.verify(signature, canonical),
        "sign": lambda: signer.sign(command),
    }
    us = dict.fromkeys(steps, float("inf"))  # interleaved passes: a busy moment hits all alike
    for _ in range(passes):
        for step, fn in steps.items():
            us[step] = min(us[step], _per_call_us(fn, n, 1))
    return {
        "case": name,
        "bytes": len(data),
        "signed_bytes": len(canonical),
        "us": us,
        "verify_over_decode": ratio(us["verify"], us["decode"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(package)
    parser.add_argument("--quick", action="store_true", help="fewer calls (seconds)")
    parser.add_argument("--tiny", action="store_true", help="a handful of calls")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    mode = mode_of(args.quick, args.tiny)
    n, passes = {"tiny": (20, 2), "quick": (300, 3), "full": (2000, 5)}[mode]
    result = envelope("signing", mode, sys.argv[1:] if argv is None else argv)
    cases = [
        ("label selector", Selector(labels={"model": "llama-70b"})),
        ("1,000 workers (array)", Selector(worker_ids=[f"worker-{i:05d}" for i in range(1000)])),
        ("10,000 workers (packed)", Selector(worker_ids=[f"worker-{i:05d}" for i in range(10000)])),
    ]
    result["parameters"] = {"calls": n, "passes": passes}
    result["cases"] = []
    for name, selector in cases:
        print(f"  {name}", flush=True)
        calls = n if selector.worker_ids is None else max(5, n // 20)
        result["cases"].append(measure_case(name, selector, calls, passes))
    small = result["cases"][0]["us"]["verify"]
    result["targets"] = [
        {
            "name": "signature check < 1 ms per command (label selector)",
            "value": small / 1000,
            "detail": f"{small:.0f} us",
            "verdict": "met" if small < TARGET_US else "missed",
        }
    ]
    return conclude(result, report(result), args.out_dir, started)


def report(result: dict[str, Any]) -> str:
    rows = [
        [
            c["case"],
            c["bytes"],
            c["us"]["decode"],
            c["us"]["verify"],
            c["verify_over_decode"],
            c["us"]["json_object"],
            c["us"]["canonical"],
            c["us"]["ed25519"],
            c["us"]["sign"],
        ]
        for c in result["cases"]
    ]
    headers = [
        "command",
        "bytes",
        "decode us",
        "verify us",
        "verify / decode",
        "json us",
        "jcs us",
        "ed25519 us",
        "sign us",
    ]
    lines = [table(rows, headers), ""]
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({t['detail']}; {fmt(t['value'])} ms)")
    return "\n".join(lines)
