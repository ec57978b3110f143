"""Per engine and policy: the pause (ack and client side), the reload, requests failed,
completed and mixed, the ratios to the idle reload; the targets; the printed tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.common import fmt, ratio, summary, table
from bench.drain.scenario import IDLE


def _p(values: Sequence[float]) -> dict[str, Any]:
    s = summary(values)
    return {k: s[k] for k in ("n", "p50", "p99", "max") if k in s}


def derive(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The engine's runs folded per mode (idle first)."""
    modes: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        drains = [r["result"].get("drain") or {} for r in mine]
        row: dict[str, Any] = {
            "reloads": len(mine),
            "wall_s": _p([r["wall_s"] for r in mine]),
            "validate_s": _p([r["result"]["validate_s"] for r in mine]),
            "copy_s": _p([r["result"]["copy_s"] for r in mine]),
            "paused_s": _p([d["paused_s"] for d in drains if "paused_s" in d]),
        }
        if mode != IDLE:
            failed_by: dict[str, int] = {}
            examples: dict[str, str] = {}
            for r in mine:
                for why, count in r["failed_by"].items():
                    failed_by[why] = failed_by.get(why, 0) + count
                for why, text in r["failed_examples"].items():
                    examples.setdefault(why, text)
            row |= {
                "gap_s": _p([r["gap_s"] for r in mine if r["gap_s"] is not None]),
                "normal_gap_s": _p([g for r in mine for g in r["normal_gaps_s"]]),
                "request_s": _p([x for r in mine for x in r["latencies_s"]]),
                "queued_request_s": _p([x for r in mine for x in r["queued_latencies_s"]]),
                "completed": sum(r["completed"] for r in mine),
                "failed": sum(r["failed"] for r in mine),
                "failed_by": failed_by,
                "failed_examples": examples,
                "mixed": sum(r["mixed"] for r in mine),
                "in_flight": sum(d.get("in_flight", 0) for d in drains),
                "aborted": sum(d.get("aborted", 0) for d in drains),
            }
        modes[mode] = row
    idle = modes.get(IDLE, {}).get("wall_s", {}).get("p50")
    for mode, row in modes.items():
        if mode == IDLE:
            continue
        row["ratios"] = {
            "gap_over_idle_reload": ratio(row["gap_s"].get("p50"), idle),
            "gap_p99_over_idle_reload": ratio(row["gap_s"].get("p99"), idle),
            "queued_request_over_request": ratio(
                row["queued_request_s"].get("p50"), row["request_s"].get("p50")
            ),
            "reload_over_idle_reload": ratio(row["wall_s"].get("p50"), idle),
        }
    return modes


def targets(engines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Verdicts on the guarantees (never on times: the ratios are reported)."""
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool, value: Any, detail: str) -> None:
        out.append({"name": name, "value": value, "verdict": "met" if ok else "missed",
                    "detail": detail})  # fmt: skip

    for engine in engines:
        name, modes = engine["engine"], engine["modes"]
        for mode in ("wait", "keep"):
            if mode in modes:
                m = modes[mode]
                add(f"{name} {mode}: no request failed", m["failed"] == 0, m["failed"],
                    f"{m['failed']} failed of {m['completed'] + m['failed']}")  # fmt: skip
        for mode in ("wait", "abort") + (("keep",) if name == "torch" else ()):
            if mode in modes:
                m = modes[mode]
                add(f"{name} {mode}: no response mixes two versions", m["mixed"] == 0,
                    m["mixed"], f"{m['mixed']} mixed of {m['completed']}")  # fmt: skip
        if "abort" in modes:
            m = modes["abort"]
            add(f"{name} abort: only the requests the drain aborted failed",
                m["failed"] <= m["aborted"], m["failed"],
                f"{m['failed']} failed, {m['aborted']} aborted by the drains")  # fmt: skip
        for mode, m in modes.items():
            if mode == IDLE:
                continue
            r = m["ratios"]["gap_over_idle_reload"]
            out.append({
                "name": f"{name} {mode}: serving gap / idle reload (p50)",
                "value": r,
                "verdict": "reported",
                "detail": f"{fmt(r)}x: gap {ms(m['gap_s'].get('p50'))} ms, idle reload "
                f"{ms(modes[IDLE]['wall_s'].get('p50'))} ms",
            })  # fmt: skip
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def report(result: dict[str, Any]) -> str:
    parts: list[str] = []
    for engine in result["engines"]:
        modes = engine["modes"]
        idle = modes[IDLE]
        head = [
            "policy", "reloads", "paused p50 ms", "paused p99 ms", "gap p50 ms", "gap p99 ms",
            "reload p50 ms", "reload p99 ms", "gap/idle", "reload/idle", "request p50 ms",
            "queued p50 ms", "failed",
            "completed", "mixed", "in flight", "aborted",
        ]  # fmt: skip
        rows: list[list[Any]] = [[
            "idle (baseline)", idle["reloads"], ms(idle["paused_s"].get("p50")),
            ms(idle["paused_s"].get("p99")), "-", "-", ms(idle["wall_s"].get("p50")),
            ms(idle["wall_s"].get("p99")), "-", "-", "-", "-", "-", "-", "-", "-", "-",
        ]]  # fmt: skip
        for mode, m in modes.items():
            if mode == IDLE:
                continue
            failed = str(m["failed"]) + (
                " (" + ", ".join(f"{k}: {v}" for k, v in sorted(m["failed_by"].items())) + ")"
                if m["failed_by"] else ""
            )  # fmt: skip
            rows.append([
                mode, m["reloads"], ms(m["paused_s"].get("p50")), ms(m["paused_s"].get("p99")),
                ms(m["gap_s"].get("p50")), ms(m["gap_s"].get("p99")),
                ms(m["wall_s"].get("p50")), ms(m["wall_s"].get("p99")),
                fmt(m["ratios"]["gap_over_idle_reload"], ".2f"),
                fmt(m["ratios"]["reload_over_idle_reload"], ".2f"),
                ms(m["request_s"].get("p50")), ms(m["queued_request_s"].get("p50")), failed, m["completed"], m["mixed"], m["in_flight"], m["aborted"],
            ])  # fmt: skip
        wait = modes.get("wait", {})
        facts = engine["facts"]
        parts.append(
            f"{engine['engine']}: {engine['clients']} clients, {facts.get('new_tokens')} new "
            f"tokens a request, checkpoint {facts.get('checkpoint_bytes', 0) / 1e6:.2f} MB; a "
            f"gap is between two {engine['ticks']}s overlapping the reload (normal under "
            f"load: p50 {ms(wait.get('normal_gap_s', {}).get('p50'))} ms, p99 "
            f"{ms(wait.get('normal_gap_s', {}).get('p99'))} ms); queued: requests that arrived "
            f"during the reload\n" + table(rows, head)
        )
    rows = [[t["name"], t["verdict"], t["detail"]] for t in result["targets"]]
    parts.append(table(rows, ["target", "verdict", "detail"]))
    return "\n\n".join(parts)
