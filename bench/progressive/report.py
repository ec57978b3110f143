"""Medians over rounds, the printed tables and the targets' verdicts."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import fmt, ratio, table

#: The issue's target: a progressive rollout takes at most this much longer than its waves by hand.
TARGET_RATIO = 1.2
#: A wave boundary's times (scenario._boundaries), in the order of the printed columns.
GAP_TIMES = (
    "total_s",
    "coordinator_read_s",
    "wake_s",
    "decide_s",
    "decide_cpu_s",
    "txn_s",
    "to_reader_s",
)


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def derive(data: dict[str, Any], n: int) -> dict[str, Any]:
    """Per round and over rounds: times, the ratio, the coordinator's CPU per worker per wave."""
    waves = len(data["waves"])
    per_round = []
    for r in data["rounds"]:
        hand, ctrl = r["hand"], r["controller"]
        idle_rate = ctrl["idle_cpu_s"] / ctrl["total_s"] if ctrl["total_s"] else 0.0
        per_round.append(
            {
                "hand_s": hand["total_s"],
                "controller_s": ctrl["total_s"],
                "ratio": ratio(ctrl["total_s"], hand["total_s"]),
                # the coordinator's CPU over its idle rate, per worker per wave (N x waves)
                "controller_cpu_ms_per_worker_wave": 1e3
                * (ctrl["coordinator_cpu_s"] - ctrl["idle_cpu_s"])
                / (n * waves),
                "controller_cpu_ms_per_worker_wave_raw": 1e3
                * ctrl["coordinator_cpu_s"]
                / (n * waves),
                "hand_cpu_ms": 1e3 * hand["coordinator_cpu_s"],
                "idle_decide_calls_per_s": ctrl["idle_decide"]["calls"] / ctrl["total_s"],
                "idle_decide_cpu_ms": 1e3 * ctrl["idle_decide"]["cpu_s"],
                "controller_cpu_ms_per_rollout": 1e3
                * (ctrl["coordinator_cpu_s"] - ctrl["idle_cpu_s"]),
                "idle_pct_core": 100 * idle_rate,
                "decisions": ctrl["decisions"],
                "decide_calls": ctrl["decide"]["calls"],
                "decide_ms": 1e3 * ctrl["decide"]["total_s"],
                "decide_cpu_ms": 1e3 * ctrl["decide"]["cpu_s"],
                "hand_decide_calls": hand["decide"]["calls"],
                "hand_decide_cpu_ms": 1e3 * hand["decide"]["cpu_s"],
                "last_ack_to_state_s": ctrl["last_ack_to_state_s"],
            }
        )

    def med(key: str) -> float | None:
        return _median([r[key] for r in per_round])

    def wave_med(arm: str, i: int, key: str) -> float | None:
        return _median([r[arm]["waves"][i][key] for r in data["rounds"]])

    per_wave = [
        {
            "wave": i,
            "workers": size,
            **{
                f"{arm}_{key}": wave_med(arm, i, key)
                for arm in ("hand", "controller")
                for key in ("to_command_s", "apply_s", "to_last_ack_s")
            },
        }
        for i, size in enumerate(data["waves"])
    ]

    def gap_med(i: int, key: str) -> float | None:
        return _median([r["controller"]["boundaries"][i].get(key) for r in data["rounds"]])

    gaps = [
        {
            "wave": data["rounds"][0]["controller"]["boundaries"][i]["wave"],
            **{key: gap_med(i, key) for key in (*GAP_TIMES, "decides_between")},
        }
        for i in range(len(data["waves"]) + 1)
    ]
    hand_s, ctrl_s = med("hand_s"), med("controller_s")
    return {
        "rounds": per_round,
        "per_wave": per_wave,
        "gaps": gaps,
        "decide_calls_per_rollout": med("decide_calls"),
        "decide_ms_per_rollout": med("decide_ms"),
        "decide_cpu_ms_per_rollout": med("decide_cpu_ms"),
        "hand_decide_calls": med("hand_decide_calls"),
        "hand_decide_cpu_ms": med("hand_decide_cpu_ms"),
        "hand_s": hand_s,
        "controller_s": ctrl_s,
        "controller_over_hand": ratio(ctrl_s, hand_s),
        "ratio_per_round_median": med("ratio"),
        "controller_cpu_ms_per_worker_wave": med("controller_cpu_ms_per_worker_wave"),
        "controller_cpu_ms_per_worker_wave_raw": med("controller_cpu_ms_per_worker_wave_raw"),
        "hand_cpu_ms": med("hand_cpu_ms"),
        "idle_decide_calls_per_s": med("idle_decide_calls_per_s"),
        "idle_decide_cpu_ms": med("idle_decide_cpu_ms"),
        "controller_cpu_ms_per_rollout": med("controller_cpu_ms_per_rollout"),
        "idle_pct_core": med("idle_pct_core"),
        "decisions_per_rollout": med("decisions"),
        "last_ack_to_state_s": med("last_ack_to_state_s"),
    }


def targets(summary: dict[str, Any], n: int, waves: int) -> list[dict[str, Any]]:
    r = summary["controller_over_hand"]
    cpu = summary["controller_cpu_ms_per_worker_wave"]
    return [
        {
            "name": f"controller <= {TARGET_RATIO}x the same waves by hand (N={n}, {waves} waves)",
            "value": r,
            "verdict": "n/a" if r is None else "met" if r <= TARGET_RATIO else "missed",
            "detail": f"{fmt(r)}x: {fmt(summary['controller_s'])} s against "
            f"{fmt(summary['hand_s'])} s (medians)",
        },
        {
            "name": "controller CPU per worker per wave",
            "value": cpu,
            "verdict": "reported",
            "detail": f"{fmt(cpu)} ms of the coordinator's CPU over idle, / (N x waves); "
            f"{fmt(summary['controller_cpu_ms_per_rollout'])} ms per rollout",
        },
    ]


def report(result: dict[str, Any]) -> str:
    ms = 1e3
    s = result["summary"]
    rows = [
        [
            i,
            rnd["order"],
            d["hand_s"] * ms,
            d["controller_s"] * ms,
            d["ratio"],
            d["decisions"],
            d["last_ack_to_state_s"] * ms,
            d["controller_cpu_ms_per_rollout"],
            d["controller_cpu_ms_per_worker_wave"],
            d["hand_cpu_ms"],
            d["idle_pct_core"],
        ]
        for i, (rnd, d) in enumerate(zip(result["rounds"], s["rounds"], strict=True))
    ]
    head = [
        "round",
        "order",
        "by hand ms",
        "controller ms",
        "ctrl/hand",
        "decisions",
        "last ack->state ms",
        "ctrl CPU ms",
        "ctrl CPU ms/worker/wave",
        "hand: coord. CPU ms",
        "idle % core",
    ]
    wave_rows = [
        [
            w["wave"],
            w["workers"],
            *(
                None if w[f"{arm}_{key}"] is None else w[f"{arm}_{key}"] * ms
                for arm in ("hand", "controller")
                for key in ("to_command_s", "apply_s", "to_last_ack_s")
            ),
        ]
        for w in s["per_wave"]
    ]
    wave_head = [
        "wave",
        "workers",
        "hand: to command ms",
        "hand: apply ms",
        "hand: wave ms",
        "ctrl: to command ms",
        "ctrl: apply ms",
        "ctrl: wave ms",
    ]
    gap_rows = [
        [
            g["wave"],
            *(None if g[key] is None else g[key] * ms for key in GAP_TIMES),
            g["decides_between"],
        ]
        for g in s["gaps"]
    ]
    gap_head = [
        "wave",
        "to command ms",
        "coord. read acks ms",
        "to decide() ms",
        "decide() ms",
        "decide() CPU ms",
        "transaction ms",
        "to reader ms",
        "decide() calls before",
    ]
    lines = [
        table(rows, head),
        "",
        "per wave, medians over rounds (to command: from the previous wave's last ack read "
        "back, or the start, to the wave's command read back; apply: command to last ack):",
        table(wave_rows, wave_head),
        "",
        "controller, from the spec's publish (wave 0) or the previous wave's last ack read here "
        "to the wave's command read here (medians; wall clocks of the two processes): when the "
        "coordinator had read the previous wave's last ack, when it started the decide() that "
        "publishes the wave (both from that same origin), decide() (wall, CPU), its "
        "transaction (writes, commit), the command reaching this reader (read_committed):",
        table(gap_rows, gap_head),
        "(end: from the last wave's last ack read here to the decision that ended the rollout, "
        "and its state read here.)",
        f"decide() per rollout: {fmt(s['decide_calls_per_rollout'])} calls, "
        f"{fmt(s['decide_ms_per_rollout'])} ms, {fmt(s['decide_cpu_ms_per_rollout'])} ms of CPU; "
        f"during the waves by hand (target retired): {fmt(s['hand_decide_calls'])} calls, "
        f"{fmt(s['hand_decide_cpu_ms'])} ms of CPU; idle (target on the agents): "
        f"{fmt(s['idle_decide_calls_per_s'])} calls/s, {fmt(s['idle_decide_cpu_ms'])} ms of CPU "
        "in a window as long as the rollout.",
        "",
        "CPU: the coordinator child's (/proc, 10 ms ticks). ctrl: during the rollout, over its "
        "idle rate (a quiet window as long as the rollout right after it, the target still on "
        "the agents); per worker per wave = / (N x waves). hand: the same coordinator during "
        "the waves by hand (target retired, its controller deciding nothing), not less idle.",
        f"controller/by hand: {fmt(s['controller_over_hand'])}x (medians: "
        f"{fmt(s['controller_s'])} s / {fmt(s['hand_s'])} s; per-round ratio median "
        f"{fmt(s['ratio_per_round_median'])})",
    ]
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({t['detail']})")
    prof = result.get("decide_profile")
    if prof:
        lines.append(
            f"\ndecide() profile over the controller's rollouts ({prof['commands']} calls, "
            f"{prof['cpu_ms_per_command']} ms of CPU each):"
        )
        lines.append(
            table(
                [
                    [x["function"], x["calls"], x["tottime_s"], x["cumtime_s"]]
                    for x in prof["top_cumtime"]
                ],
                ["function (by cumtime)", "calls", "tottime s", "cumtime s"],
            )
        )
    return "\n".join(lines)
