"""bench.signing runs (tiny mode, in-process) and writes its JSON with every case and the
target; its numbers are measurements, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench.signing.main import main


def test_bench_signing_tiny_writes_its_results(tmp_path: Path) -> None:
    assert main(["--tiny", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("signing-*.json")
    data = json.loads(path.read_text())
    assert data["benchmark"] == "signing" and data["mode"] == "tiny"
    assert [c["case"] for c in data["cases"]] == [
        "label selector",
        "1,000 workers (array)",
        "10,000 workers (packed)",
    ]
    for case in data["cases"]:
        assert set(case["us"]) == {
            "decode",
            "verify",
            "json_object",
            "canonical",
            "ed25519",
            "sign",
        }
        assert case["verify_over_decode"] > 0
    (target,) = data["targets"]
    assert target["verdict"] in ("met", "missed")
