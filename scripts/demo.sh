#!/usr/bin/env bash
# Set up (idempotent) and run the local demo: a Kafka broker, a coordinator, three workers with
# real models, rollouts to completion. Extra arguments go to `controlplane demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
exec .venv/bin/controlplane demo "$@"
