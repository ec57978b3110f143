"""The benchmarks' smoke tests: each runs its ``--tiny`` mode as a subprocess and must exit 0 and
write well-formed JSON with the expected keys. Times and ratios are never asserted: they are
measurements, and this machine is shared.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_bench(name: str, out_dir: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--tiny", "--out-dir", str(out_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"bench.{name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    files = sorted(out_dir.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    data: dict[str, Any] = json.loads(files[0].read_text())
    assert data["benchmark"] == name
    assert data["mode"] == "tiny"
    for key in ("date", "commit", "dirty", "command", "elapsed_s", "targets"):
        assert key in data, key
    assert {"cpu_model", "cores", "ram_gb"} <= data["machine"].keys()
    for key in ("loadavg_start", "loadavg_end"):
        assert len(data[key]) == 3
    for target in data["targets"]:
        assert {"name", "verdict"} <= target.keys()
    assert "target" in proc.stdout  # the printed table names the targets
    return data


def number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


@pytest.mark.kafka
def test_fanout_tiny(tmp_path: Path) -> None:
    data = run_bench("fanout", tmp_path)
    assert [lv["n"] for lv in data["levels"]] == data["parameters"]["n"]
    for level in data["levels"]:
        assert number(level["floor"]["round_trip_s"]["p50"])
        for key in ("converge_s", "last_ack_s", "ack_s", "received_s", "publish_s"):
            assert {"p50", "p99", "max"} <= level["rollouts"][key].keys(), key
        assert level["rollouts"]["ack_s"]["n"] == level["n"] * data["parameters"]["repeats"]
        assert number(level["http"]["sequential_s"]["p50"])
        assert number(level["http"]["concurrent_s"]["p50"])
        assert number(level["idle"]["agents_pct_core"])
        assert number(level["rollout_cpu"]["agents_cpu_ms_per_command"])
        assert {"converge_over_floor", "converge_over_http_concurrent"} <= level["ratios"].keys()


@pytest.mark.kafka
def test_aggregate_tiny(tmp_path: Path) -> None:
    data = run_bench("aggregate", tmp_path)
    assert data["produce"]["acks"] >= data["parameters"]["acks"]
    for reader in ("bare", "bus", "follower"):
        assert number(data[reader]["acks_per_s"]), reader
    follower = data["follower"]
    assert follower["undecodable"] == 0
    assert follower["rollouts"] == data["produce"]["commands"]
    assert sum(follower["phases"].values()) == follower["rollouts"]
    assert number(data["ratios"]["follower_over_bare"])
    assert data["profile"]["top_tottime"] and data["profile"]["top_cumtime"]
    assert number(data["in_memory"]["decode_us"])


def test_reload_tiny(tmp_path: Path) -> None:
    data = run_bench("reload", tmp_path)
    assert data["checkpoint"]["bytes"] > 0
    cpu = data["sections"]["torch"]
    names = {run["name"] for run in cpu["runs"]}
    assert any(n.startswith("memcpy") for n in names)
    assert any(n.startswith("ours") for n in names)
    assert any(n.startswith("naive") for n in names)
    assert any(n.startswith("load_file") for n in names)
    assert {run["cold"] for run in cpu["runs"]} == {False, True}
    for run in cpu["runs"]:
        assert number(run["gbps"]) and number(run["peak_extra_anon_mb"]), run["name"]
    assert {"cached_over_memcpy", "cold_over_read_cold", "cached_over_naive"} <= data["ratios"][
        "cpu"
    ].keys()
    xla = data["sections"]["xla"]
    assert "runs" in xla or "skipped" in xla
    assert "skipped" in data["sections"]["cuda"] or "runs" in data["sections"]["cuda"]
