#!/usr/bin/env bash
# Idempotent set-up of everything the demo and the tests need, on a fresh machine or a warm one:
# Java 17+ and Maven, Chromium and its WebDriver (Debian packages, only if missing; the browser test
# and the dashboard benchmark drive them), uv, the Python environment in .venv (torch 2.9.0 +
# torch_xla 2.9.0 + model-signing + Selenium + the reload benchmark's peer loaders, runai-model-streamer
# and fastsafetensors + the package, editable), and Apache Kafka's jars (cached).
# A second run downloads nothing: uv's cache and the jar cache live under ~/.cache.
set -euo pipefail
cd "$(dirname "$0")/.."

export SSL_CERT_FILE="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
export UV_LINK_MODE="${UV_LINK_MODE:-copy}"

# apt-get as root, or through passwordless sudo; `apt-get update` at most once per run.
as_root() {
  if ((EUID == 0)); then
    "$@"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo -n "$@"
  else
    return 126
  fi
}
apt_updated=""
apt_install() {
  echo "setup: installing $* with apt-get"
  if [[ -z "$apt_updated" ]]; then
    as_root apt-get update -qq || return
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
if ((${#need_apt[@]})); then
  apt_install "${need_apt[@]}"
fi

# Headless Chromium and chromedriver for tests/browser and bench/dashboard (Selenium drives them;
# it downloads no browser: tests/browser/chrome.py finds these two).
need_browser=()
[[ -x /usr/bin/chromium ]] || need_browser+=(chromium)
[[ -x /usr/bin/chromedriver ]] || need_browser+=(chromium-driver)
if ((${#need_browser[@]})); then
  if ((EUID != 0)) && ! { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
    echo "setup: cannot install ${need_browser[*]} (not root, no passwordless sudo): the browser tests will fail until \`sudo apt-get install chromium chromium-driver\` is run" >&2
  else
    apt_install "${need_browser[@]}"
  fi
fi

PY="${PYTHON:-python3}"
# shellcheck source=scripts/uv.sh
source scripts/uv.sh

if [[ ! -x .venv/bin/python ]]; then
  uv venv -q -p "$PY" .venv
fi
echo "setup: Python environment .venv (torch 2.9.0 + torch_xla 2.9.0, model-signing 1.1.1, the reload benchmark's peer loaders)"
uv pip install -q -p .venv/bin/python -e ".[tpu,test,verify,bench]"

echo "setup: Apache Kafka jars"
.venv/bin/controlplane broker install
