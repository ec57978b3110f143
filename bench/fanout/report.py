"""The printed tables and the targets' verdicts."""

from __future__ import annotations

from typing import Any

from bench.common import fmt, table


def report(result: dict[str, Any]) -> str:
    ms = 1e3
    rows, rows2 = [], []
    for lv in result["levels"]:
        r, h, f = lv["rollouts"], lv.get("http", {}), lv["floor"]["round_trip_s"]
        cpu, idle = lv["rollout_cpu"], lv["idle"]
        rows.append(
            [
                lv["n"],
                f["p50"] * ms,
                r["converge_s"]["p50"] * ms,
                r["converge_s"]["p99"] * ms,
                r["ack_s"]["p50"] * ms,
                r["ack_s"]["p99"] * ms,
                h.get("sequential_s", {}).get("p50", 0) * ms or None,
                h.get("concurrent_s", {}).get("p50", 0) * ms or None,
                lv["ratios"]["converge_over_floor"],
                lv["ratios"]["converge_over_http_concurrent"],
            ]
        )
        rows2.append(
            [
                lv["n"],
                lv["agents"]["processes"],
                r["publish_s"]["p50"] * ms,
                r["received_s"]["p50"] * ms,
                r["received_s"]["p99"] * ms,
                cpu["agents_cpu_ms_per_command"],
                lv["n"] * cpu["agents_cpu_ms_per_command"] / (cpu["cores"] or 1),
                cpu["broker_cpu_ms_per_command"],
                cpu["follower_cpu_ms_per_rollout"],
                idle["agents_pct_core"],
                idle["broker_pct_core"],
            ]
        )
    head = [
        "N",
        "floor p50 ms",
        "converge p50 ms",
        "converge p99 ms",
        "ack p50 ms",
        "ack p99 ms",
        "HTTP seq p50 ms",
        "HTTP conc p50 ms",
        "conv/floor",
        "conv/HTTP conc",
    ]
    head2 = [
        "N",
        "procs",
        "publish p50 ms",
        "received p50 ms",
        "received p99 ms",
        "agent CPU ms/cmd",
        "CPU bound ms",
        "broker CPU ms/cmd",
        "follower CPU ms/rollout",
        "idle agents % core",
        "idle broker % core",
    ]
    lines = [table(rows, head), "", table(rows2, head2), ""]
    for failed in result.get("failed_levels", []):
        lines.append(f"N={failed['n']} failed: {failed['error']}")
    log = result.get("broker_log", {})
    if log.get("too_many_open_files"):
        lines.append(f"broker log: 'Too many open files' {log['too_many_open_files']} times")
    if log.get("shut_down_all_log_dirs_failed"):
        lines.append("broker log: the broker shut down (all log dirs failed)")
    lines.append("CPU bound: N x agent CPU per command / cores, the least a rollout can take here.")
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({t['detail']})")
    probed = [lv for lv in result["levels"] if "broker_probe" in lv]
    if probed:
        lines += ["", broker_table(probed)]
    for lv in result["levels"]:
        prof = lv.get("agent_profile")
        if prof:
            lines.append(
                f"\nagent profile at N={lv['n']} (CPU time of the event loops, "
                f"{prof['cpu_ms_per_command']} ms per command):"
            )
            lines.append(
                table(
                    [
                        [x["function"], x["calls"], x["tottime_s"], x["cumtime_s"]]
                        for x in prof["top_tottime"]
                    ],
                    ["function (by tottime)", "calls", "tottime s", "cumtime s"],
                )
            )
            calls = prof.get("calls_per_command", {})
            lines.append(
                "per command, calls and cumulative CPU ms: "
                + ", ".join(
                    f"{name} {per:g} ({ms:g} ms)"
                    for name, (per, ms) in calls.items()
                    if per >= 0.01
                )
            )
    return "\n".join(lines)


def broker_table(levels: list[dict[str, Any]]) -> str:
    """``--broker-probe``: what the broker saw, idle and over the timed rollouts."""
    rows = []
    for lv in levels:
        bp = lv["broker_probe"]
        end = bp["snapshots"].get("idle_end", {})
        idle, roll = bp.get("idle", {}), bp.get("rollouts", {})
        per_s = idle.get("requests_per_s", {})
        rss = lv["agents"].get("rss_mb_idle") or []
        rows.append(
            [
                lv["n"],
                end.get("rss_mb"),
                end.get("fds"),
                end.get("connections"),
                end.get("fetch_sessions"),
                idle.get("fetch_session_evictions"),
                idle.get("broker_pct_core"),
                per_s.get("FetchConsumer"),
                per_s.get("Produce"),
                roll.get("broker_pct_core"),
                bp.get("offset_commits_per_command"),
                lv["agents"].get("consumer_groups"),
                sum(rss) / max(1, sum(lv["agents"]["agents_per_process"])) if rss else None,
            ]
        )
    head = [
        "N",
        "broker RSS MB",
        "broker fds",
        "connections",
        "fetch sessions",
        "evictions (idle)",
        "idle broker % core",
        "idle fetches/s",
        "idle produce/s",
        "rollouts broker % core",
        "commits/command",
        "groups listed",
        "agent RSS MB/agent",
    ]
    return "broker (--broker-probe):\n" + table(rows, head)


def targets(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_n = {lv["n"]: lv for lv in levels}
    out: list[dict[str, Any]] = []
    ref = by_n.get(100) or by_n[max(by_n)]
    r = ref["ratios"]["converge_over_floor"]
    out.append(
        {
            "name": "converge <= 5x floor at N=100"
            + ("" if ref["n"] == 100 else f" (this run: N={ref['n']})"),
            "n": ref["n"],
            "value": r,
            "verdict": "n/a" if r is None else "met" if r <= 5 else "missed",
            "detail": f"N={ref['n']}: {fmt(r)}x",
        }
    )
    http = [lv for lv in levels if lv["n"] >= 100 and "http" in lv] or [
        lv for lv in levels if lv["n"] == max(by_n) and "http" in lv
    ]
    if http:
        values = {lv["n"]: lv["ratios"]["converge_over_http_concurrent"] for lv in http}
        ok = all(v is not None and v < 1 for v in values.values())
        out.append(
            {
                "name": "faster than concurrent HTTP from N>=100"
                + ("" if min(values) >= 100 else f" (this run: N={min(values)})"),
                "values": values,
                "verdict": "met" if ok else "missed",
                "detail": ", ".join(f"N={k}: {fmt(v)}x" for k, v in values.items()),
            }
        )
    top = by_n[max(by_n)]
    out.append(
        {
            "name": f"idle CPU of {top['n']} agents",
            "value": top["idle"]["agents_pct_core"],
            "verdict": "reported",
            "detail": f"{fmt(top['idle']['agents_pct_core'])}% of one core, broker "
            f"{fmt(top['idle']['broker_pct_core'])}%",
        }
    )
    return out
