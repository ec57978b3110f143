"""``bench.drain --engine vllm --quick`` (a real vLLM engine in process, on the CPU): it exits 0
and writes well-formed JSON with every policy's pause, requests failed and completed. Times and
ratios are never asserted; the verdicts are printed into the log (``[bench] ...``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from tests.integration.test_bench_quick import number, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_drain_quick_on_vllm_in_process(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    data = run_bench(pytestconfig, "drain", tmp_path, "--engine", "vllm", timeout=840)
    assert data["parameters"]["engine"] == "vllm"
    (engine,) = data["engines"]
    assert engine["engine"] == "vllm-in-process"
    modes = engine["modes"]
    assert list(modes) == ["idle", "wait", "abort", "keep"]
    for mode in ("wait", "abort", "keep"):
        row = modes[mode]
        assert row["reloads"] == data["parameters"]["rounds"], mode
        assert number(row["paused_s"]["p50"]) and number(row["gap_s"]["p99"]), mode
        assert row["completed"] > 0 and row["in_flight"] > 0, mode
    assert modes["wait"]["failed"] == 0  # a wait drain fails nothing (docs/wire.md)
    assert modes["abort"]["failed"] == sum(modes["abort"]["failed_by"].values())
    assert {t["verdict"] for t in data["targets"]} <= {"met", "missed", "reported"}
