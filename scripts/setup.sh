#!/usr/bin/env bash
# Idempotent set-up of everything the demo and the tests need, on a fresh machine or a warm one:
# Java 17+ and Maven (Debian packages, only if missing), uv, the Python environment in .venv
# (torch 2.9.0 + torch_xla 2.9.0 + model-signing + the package, editable), and Apache Kafka's jars (cached).
# A second run downloads nothing: uv's cache and the jar cache live under ~/.cache.
set -euo pipefail
cd "$(dirname "$0")/.."

export SSL_CERT_FILE="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
export UV_LINK_MODE="${UV_LINK_MODE:-copy}"

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]} with apt-get"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

PY="${PYTHON:-python3}"
# shellcheck source=scripts/uv.sh
source scripts/uv.sh

if [[ ! -x .venv/bin/python ]]; then
  uv venv -q -p "$PY" .venv
fi
echo "setup: Python environment .venv (torch 2.9.0 + torch_xla 2.9.0, model-signing 1.1.1)"
uv pip install -q -p .venv/bin/python -e ".[tpu,test,verify]"

echo "setup: Apache Kafka jars"
.venv/bin/controlplane broker install
