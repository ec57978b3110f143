"""The printed table (one column per configuration, as in issue 18) and the targets' verdicts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.common import fmt, ratio, table
from bench.scale import HEARTBEAT_PERIOD_S

MB = 2**20
#: The issue's targets, at 10,000 workers and 100 past rollouts.
PUBLISH_S = 2.0
STATUS_ONE_S = 1.0
READY_S = 10.0
READY_RSS_MB = 1024.0
SUMMARY_P99_S = 0.1
DASHBOARD_BYTES = 100 * 1024
ACKS_VISIBLE_S = 2.0
#: The rows whose cost is a replay of the log, reported as a ratio to the bare consumer's read.
REPLAY_ROWS = ("publish", "status_one", "status_all", "ready")


def error_code(run: dict[str, Any]) -> str | None:
    """The first coded error (``NO_MATCHING_WORKERS``...) the command printed, if it failed."""
    if run.get("exit_code") == 0:
        return None
    text = run.get("stderr_tail", "")
    path = Path(run.get("stdout_path", ""))
    if path.is_file() and path.stat().st_size < 65536:
        text = path.read_text(errors="replace") + " " + text
    found = re.search(r"\b[A-Z]{2,}(?:_[A-Z]+)+\b", text)
    return found.group(0) if found else None


def _cli_cell(run: dict[str, Any] | None, extra: str = "") -> str:
    if not run:
        return "-"
    cell = f"{run['wall_s']:.2f} s, {run['max_rss_mb']:.0f} MB{extra}"
    if run["killed_at_cap"]:
        return f"killed at the cap after {run['wall_s']:.0f} s, {run['max_rss_mb']:.0f} MB"
    if run["exit_code"] != 0:
        return f"**fails** (exit {run['exit_code']}, {error_code(run) or '?'}) in {cell}"
    return cell


def _http_cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    if s["s"].get("n", 0) == 0:
        return f"no answer ({', '.join(s['statuses'])})"
    return (
        f"p50 {fmt(s['s']['p50'])} s, p99 {fmt(s['s']['p99'])} s, "
        f"{fmt(s['bytes'] / MB)} MB (n={s['s']['n']})"
    )


def derive(level: dict[str, Any]) -> dict[str, Any]:
    """The figures each row and target reads, ``None`` where not measured."""
    cli = level.get("cli", {})
    api = level.get("api", {})
    start = api.get("start", {})
    floor_s = level.get("floor", {}).get("elapsed_s")
    walls = {
        "publish": cli.get("publish", {}).get("wall_s"),
        "status_one": cli.get("status_one", {}).get("wall_s"),
        "status_all": cli.get("status_all", {}).get("wall_s"),
        "ready": start.get("ready_s"),
    }
    summaries = api.get("summary", {})
    watcher = api.get("watcher", {})
    dash = api.get("dashboard", {})
    return {
        "floor_s": floor_s,
        "ratios": {k: ratio(v, floor_s) for k, v in walls.items()},
        "summary_p99_s": max(
            (s["s"].get("p99") or float("inf") for s in summaries.values()), default=None
        ),
        "dashboard_bytes": dash.get("bytes"),
        "dashboard_s": dash["s"][len(dash["s"]) // 2] if dash.get("s") else None,
        "visible_s": api.get("burst", {}).get("visible_s"),
        "false_alive": watcher.get("alive_below_n_count"),
        "false_phase": watcher.get("in_progress_shown_ended_count"),
        "status_one_phase": cli.get("status_one", {}).get("phase"),
    }


def rows(levels: list[dict[str, Any]]) -> list[list[Any]]:
    def each(fn: Any) -> list[str]:
        out = []
        for lv in levels:
            try:
                out.append(fn(lv))
            except (KeyError, TypeError, IndexError):
                out.append("-")
        return out

    def x_floor(lv: dict[str, Any], key: str) -> str:
        r = lv["derived"]["ratios"].get(key)
        run = lv.get("cli", {}).get(key, {})
        more = ">" if run.get("killed_at_cap") else ""  # the cap, not the command, ended it
        return f"; {more}{r:.1f}x the floor" if r is not None else ""

    def publish(lv: dict[str, Any]) -> str:
        run = lv["cli"]["publish"]
        pinned = run.get("pinned")
        extra = f", pinned {pinned} of {lv['n']}" if pinned is not None else ""
        return _cli_cell(run, extra) + x_floor(lv, "publish")

    def status_one(lv: dict[str, Any]) -> str:
        run = lv["cli"]["status_one"]
        return _cli_cell(run, f", shown {run.get('phase')}") + x_floor(lv, "status_one")

    def status_one_api(lv: dict[str, Any]) -> str:
        run = lv["api"]["status_one_api"]
        return _cli_cell(run, f", shown {run.get('phase')}")

    def status_all(lv: dict[str, Any]) -> str:
        run = lv["cli"]["status_all"]
        out = f", {run['stdout_bytes'] / MB:.1f} MB output"
        return _cli_cell(run, out) + x_floor(lv, "status_all")

    def ready(lv: dict[str, Any]) -> str:
        s = lv["api"]["start"]
        if not s.get("ready"):
            return f"not ready: {s.get('error')}"
        peak = lv["api"].get("memory_at_end", {}).get("peak_rss_mb")
        second = (lv["api"].get("restart") or {}).get("writer_start") or {}
        again = f"; again: {second['ready_s']:.2f} s" if second.get("ready") else ""
        return (
            f"{s['ready_s']:.2f} s, {s['rss_mb_at_ready']:.0f} MB at ready, "
            f"{fmt(peak, '.0f')} MB peak after the API calls" + x_floor(lv, "ready") + again
        )

    def restart(lv: dict[str, Any]) -> str:
        r = lv["api"].get("restart")
        if r is None or "ready" not in r:
            written = (r or {}).get("written") or {}
            return f"not run: {written.get('error', 'no snapshot written')}"
        if not r.get("ready"):
            return f"not ready: {r.get('error')}"
        snap = r.get("snapshot") or {}
        came = snap.get("started_from", "?")
        if came == "snapshot":
            came = f"from a {(snap.get('bytes') or 0) / 2**20:.1f} MB snapshot"
            came += f" restored in {fmt(snap.get('restore_s'))} s"
        else:
            came = f"{came} ({snap.get('reason')})"
        return f"{r['ready_s']:.2f} s, {r['rss_mb_at_ready']:.0f} MB at ready; {came}"

    def summaries(lv: dict[str, Any]) -> str:
        found = lv["api"]["summary"]
        if not found:
            return "absent"
        return "; ".join(f"`{p}` {_http_cell(s)}" for p, s in found.items())

    def dashboard(lv: dict[str, Any]) -> str:
        d = lv["api"]["dashboard"]
        return (
            f"{fmt(lv['derived']['dashboard_s'])} s (median of {d['polls']}), "
            f"{fmt(d['bytes'] / MB)} MB ({len(d['urls'])} requests)"
        )

    def healthz(lv: dict[str, Any]) -> str:
        h = lv["api"]["healthz_under_load"]
        return (
            f"max {fmt(h['healthz_s'].get('max'))} s while `{h['big_url']}` took "
            f"{fmt(h['big_s'])} s"
        )

    def burst(lv: dict[str, Any]) -> str:
        b = lv["api"]["burst"]
        if "visible_s" not in b:
            return f"{b.get('error')}"
        return (
            f"{b['visible_s']:.2f} s after the last ack ({b['acks']} acks produced in "
            f"{b['produce_s']:.2f} s; {b['from_first_ack_s']:.2f} s from the first)"
        )

    def false_verdicts(lv: dict[str, Any]) -> str:
        w = lv["api"]["watcher"]
        low = w["alive_below_n"]
        parts = [
            f"alive < N {w['alive_below_n_count']} of {w['polls']} polls"
            + (f" (min {min(x['alive'] for x in low)})" if low else ""),
            f"in-progress shown ended {w['in_progress_shown_ended_count']}",
        ]
        if w.get("timed_out_past_progress_deadline"):
            parts.append(
                f"(not counted: {w['timed_out_past_progress_deadline']} polls showing it timed "
                "out by the progress deadline, its last ack older than 600 s)"
            )
        if lv["derived"]["status_one_phase"] in ("failed", "timed_out", "aborted"):
            parts.append(f"`status <id>` said {lv['derived']['status_one_phase']}")
        return "; ".join(parts)

    def generator(lv: dict[str, Any]) -> str:
        g = lv["generator"]
        if "error" in g:
            return f"**died**: {g['error'][:120]}"
        late_s = g["behind_max"] / lv["n"] * HEARTBEAT_PERIOD_S
        lost = f", **{g['failed']} lost** (not confirmed in 3 periods)" if g.get("failed") else ""
        return (
            f"{g['sent']} heartbeats, at most {g['behind_max']} late ({late_s:.1f} s behind)"
            f"{lost}, {g['cpu_s']:.0f} CPU s"
        )

    def floor(lv: dict[str, Any]) -> str:
        f = lv["floor"]
        topics = ", ".join(f"{v} {k.rsplit('.', 1)[-1]}" for k, v in f["by_topic"].items())
        return f"{f['elapsed_s']:.2f} s, {f['records']} records ({topics})"

    return [
        ["bare consumer to the end (the floor)", *each(floor), "-"],
        [
            "`reload-weights --selector model=big` (publish)",
            *each(publish),
            f"< {PUBLISH_S:g} s",
        ],
        ["`status <id> --json` (in progress)", *each(status_one), f"< {STATUS_ONE_S:g} s"],
        [
            "`status <id> --json --api URL` (asks the coordinator)",
            *each(status_one_api),
            f"< {STATUS_ONE_S:g} s",
        ],
        ["`status --json` (all)", *each(status_all), "-"],
        [
            "coordinator start to ready",
            *each(ready),
            f"< {READY_S:g} s, RSS < {READY_RSS_MB / 1024:g} GB",
        ],
        [
            "coordinator restart to ready (after it wrote a snapshot)",
            *each(restart),
            f"< {READY_S:g} s, RSS < {READY_RSS_MB / 1024:g} GB",
        ],
        ["`GET /api/v1/workers`", *each(lambda lv: _http_cell(lv["api"]["workers"])), "-"],
        [
            "`GET /api/v1/rollouts?limit=50`",
            *each(lambda lv: _http_cell(lv["api"]["rollouts_limit_50"])),
            "-",
        ],
        ["summary endpoints", *each(summaries), f"p99 < {SUMMARY_P99_S * 1e3:g} ms"],
        ["one dashboard update", *each(dashboard), f"< {DASHBOARD_BYTES // 1024} KB"],
        ["`GET /metrics`", *each(lambda lv: _http_cell(lv["api"]["metrics"])), "-"],
        ["`/healthz` while a big response is built", *each(healthz), "-"],
        [
            "one rollout's 3N acks in a burst until the API shows it succeeded",
            *each(burst),
            f"< {ACKS_VISIBLE_S:g} s",
        ],
        ["false verdicts (watcher)", *each(false_verdicts), "none"],
        ["heartbeat generator", *each(generator), "-"],
    ]


def _verdict(value: float | None, limit: float) -> str:
    return "missed" if value is None else "met" if value < limit else "missed"


def targets(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for lv in levels:
        d, at = lv["derived"], f"(N={lv['n']}, R={lv['rollouts']})"
        cli, api = lv.get("cli", {}), lv.get("api", {})
        publish = cli.get("publish", {})
        pub_s = publish.get("wall_s") if publish.get("exit_code") == 0 else None
        one = cli.get("status_one", {})
        one_s = one.get("wall_s") if one.get("exit_code") == 0 else None
        by_api = api.get("status_one_api", {})
        by_api_s = by_api.get("wall_s") if by_api.get("exit_code") == 0 else None
        start = api.get("start", {})
        again = api.get("restart") or {}
        summaries = api.get("summary")
        false = (d["false_alive"] or 0) + (d["false_phase"] or 0)
        for said in (d["status_one_phase"], by_api.get("phase")):
            if said in ("failed", "timed_out", "aborted"):
                false += 1
        pinned = publish.get("pinned")
        if pinned is not None and pinned < lv["n"]:
            false += 1  # live workers left out of the publish: judged lost
        out += [
            {
                "name": f"publish with a selector < {PUBLISH_S:g} s {at}",
                "value": pub_s,
                "verdict": _verdict(pub_s, PUBLISH_S),
                "detail": _cli_cell(publish) if publish else "not run",
            },
            {
                "name": f"status <id> < {STATUS_ONE_S:g} s {at}",
                "value": one_s,
                "verdict": _verdict(one_s, STATUS_ONE_S),
                "detail": _cli_cell(one) if one else "not run",
            },
            {
                "name": f"status <id> --api < {STATUS_ONE_S:g} s {at}",
                "value": by_api_s,
                "verdict": _verdict(by_api_s, STATUS_ONE_S),
                "detail": _cli_cell(by_api) if by_api else "not run",
            },
            {
                "name": f"coordinator ready < {READY_S:g} s {at}",
                "value": start.get("ready_s"),
                "verdict": _verdict(start.get("ready_s"), READY_S),
                "detail": f"{fmt(start.get('ready_s'))} s" if start.get("ready") else "not ready",
            },
            {
                "name": f"coordinator RSS at ready < 1 GB {at}",
                "value": start.get("rss_mb_at_ready"),
                "verdict": _verdict(start.get("rss_mb_at_ready"), READY_RSS_MB),
                "detail": f"{fmt(start.get('rss_mb_at_ready'), '.0f')} MB",
            },
            {
                "name": f"coordinator restart ready < {READY_S:g} s {at}",
                "value": again.get("ready_s"),
                "verdict": _verdict(again.get("ready_s"), READY_S),
                "detail": f"{fmt(again.get('ready_s'))} s, restored from "
                f"{(again.get('snapshot') or {}).get('started_from')}"
                if again.get("ready")
                else "not ready / not run",
            },
            {
                "name": f"coordinator restart RSS at ready < 1 GB {at}",
                "value": again.get("rss_mb_at_ready"),
                "verdict": _verdict(again.get("rss_mb_at_ready"), READY_RSS_MB),
                "detail": f"{fmt(again.get('rss_mb_at_ready'), '.0f')} MB",
            },
            {
                "name": f"summary endpoints p99 < {SUMMARY_P99_S * 1e3:g} ms {at}",
                "value": d["summary_p99_s"],
                "verdict": _verdict(d["summary_p99_s"], SUMMARY_P99_S),
                "detail": "absent"
                if not summaries
                else f"worst p99 {fmt(d['summary_p99_s'])} s over {len(summaries)} endpoint(s)",
            },
            {
                "name": f"one dashboard update < {DASHBOARD_BYTES // 1024} KB {at}",
                "value": d["dashboard_bytes"],
                "verdict": _verdict(d["dashboard_bytes"], DASHBOARD_BYTES),
                "detail": f"{fmt((d['dashboard_bytes'] or 0) / 1024, '.0f')} KB, "
                f"{fmt(d['dashboard_s'])} s",
            },
            {
                "name": f"3N acks visible as succeeded < {ACKS_VISIBLE_S:g} s {at}",
                "value": d["visible_s"],
                "verdict": _verdict(d["visible_s"], ACKS_VISIBLE_S),
                "detail": f"{fmt(d['visible_s'])} s",
            },
            {
                "name": f"no false verdicts {at}",
                "value": false,
                "verdict": "met" if false == 0 and lv.get("api", {}).get("watcher") else "missed",
                "detail": f"{d['false_alive']} polls with alive < N, {d['false_phase']} with the "
                f"in-progress rollout shown ended, status <id> said {d['status_one_phase']}, "
                f"the publish pinned {pinned} of {lv['n']}",
            },
        ]
    return out


def report(result: dict[str, Any]) -> str:
    levels = result["levels"]
    heads = [f"N={lv['n']}, R={lv['rollouts']}" for lv in levels]
    out = [
        "bench.scale: the product's own commands and endpoints at fleet scale "
        "(the floor: a bare consumer reading the same topics to their end)",
        "",
        table(rows(levels), ["measurement", *heads, "target"]),
        "",
        table(
            [[t["name"], t["verdict"], t["detail"]] for t in result["targets"]],
            ["target", "verdict", "measured"],
        ),
    ]
    for lv in levels:
        if lv.get("error"):
            out.append(f"\nN={lv['n']} R={lv['rollouts']}: {lv['error']}")
    return "\n".join(out)
