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


def test_sidecar_abort_is_judged_by_its_counts() -> None:
    """The sidecar's ``aborted`` comes from vLLM's finish counters (docs/vllm.md), so its abort
    target is judged like the other engines': more failures than the drains aborted miss it."""
    from bench.drain.report import targets

    def engine(failed: int, aborted: int) -> dict[str, object]:
        row = {"failed": failed, "aborted": aborted, "completed": 10, "mixed": 0,
               "gap_s": {}, "ratios": {"gap_over_idle_reload": None}}  # fmt: skip
        return {"engine": "vllm-sidecar", "modes": {"idle": {"wall_s": {}}, "abort": row}}

    name = "vllm-sidecar abort: only the requests the drain aborted failed"
    for (failed, aborted), verdict in (((3, 2), "missed"), ((2, 2), "met")):
        (found,) = [t for t in targets([engine(failed, aborted)]) if t["name"] == name]
        assert found["verdict"] == verdict, (failed, aborted, found)


def test_sidecar_load_keeps_requests_in_vllm() -> None:
    """The full run's sidecar load: longer requests than the in-process one's (16 tokens are
    generated in ~35 ms, before a reload's pause lands), options to change it; --quick keeps
    the small in-process load."""
    from bench.drain.main import load_of, parse_args

    full = parse_args(["--engine", "vllm"])
    assert load_of("vllm-sidecar", full)[1] > load_of("vllm-in-process", full)[1]
    assert load_of("vllm-sidecar", parse_args(["--engine", "vllm", "--sidecar-clients", "9",
                                               "--sidecar-new-tokens", "64"])) == (9, 64)  # fmt: skip
    quick = parse_args(["--engine", "vllm", "--quick"])
    assert quick.shapes == ["vllm-in-process"] and load_of("vllm-in-process", quick) == (2, 8)
