#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, component, and integration tests
# against a real Apache Kafka broker this suite starts itself (or $KAFKA_BOOTSTRAP).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
exec .venv/bin/python -m pytest "$@"
