#!/usr/bin/env bash
# The GPU checks, in under 7 minutes on a machine with an NVIDIA GPU:
#   1. the GPU tests (pytest -m gpu: every runner component test on the CUDA torch runner),
#   2. the CUDA reload benchmark (~1 GB checkpoint: pinned and pageable H2D bandwidth, the naive
#      safe_open loop, load_file(cuda) + load_state_dict and + copy_, the peers users would pick
#      instead on the same file (runai-model-streamer streaming to cuda, fastsafetensors'
#      nogds GPU path: pread into a bounce buffer, then H2D; each at its defaults and at the best
#      of its documented settings, swept on the GPU), and the runner's pinned double-buffered
#      staging with H2D overlap; cached and cold), beside the CPU section of the same run (its
#      peers and the machine's limits: parallel memcpy, parallel reads). A peer that is not
#      installed (the [bench] extra) or fails gets a row that says why.
# Everything goes to OUTDIR: environment.txt, gpu-tests.log/.xml, reload-*.json, reload.log,
# summary.txt. Exit status: 0 when both steps worked, 1 otherwise.
#
#   bash bench/gpu.sh OUTDIR              # PYTHON=/path/to/python to choose the interpreter
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash bench/gpu.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"  # torch_xla, if imported, must not grab the GPU
START=$(date +%s)

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "host: $(uname -a)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2-) x $(nproc)"
    echo "ram: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
    echo "loadavg: $(cut -d' ' -f1-3 /proc/loadavg)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
    "$PY" -c 'from bench.reload.peers import FASTSAFETENSORS, RUNAI, version; print("peers:", ", ".join(d + " " + (version(d) or "not installed") for d in (RUNAI, FASTSAFETENSORS)))' 2>&1
} > "$OUT/environment.txt"
cat "$OUT/environment.txt"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no usable CUDA device for $PY: nothing to run" | tee "$OUT/summary.txt"
    exit 1
fi

# 1. GPU tests (bounded: 60 s).
timeout 60 "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
    > "$OUT/gpu-tests.log" 2>&1
TESTS_RC=$?
case $TESTS_RC in
    0) TESTS="passed" ;;
    5) TESTS="none collected (the gpu-marked runner tests are missing or were deselected)" ;;
    124) TESTS="timed out after 60 s" ;;
    *) TESTS="failed (exit $TESTS_RC)" ;;
esac
echo "gpu tests: $TESTS"

# 2. The reload benchmark: the CPU section and the CUDA section (bounded: 330 s).
timeout 330 "$PY" -m bench.reload --quick --sections torch,cuda --repeats 3 --cold-repeats 1 \
    --out-dir "$OUT" > "$OUT/reload.log" 2>&1
BENCH_RC=$?
tail -n 60 "$OUT/reload.log"
[ $BENCH_RC -eq 124 ] && echo "reload benchmark: timed out after 330 s"

{
    echo "gpu tests: $TESTS"
    echo "reload benchmark: exit $BENCH_RC ($(ls "$OUT"/reload-*.json 2>/dev/null | tr '\n' ' '))"
    echo "elapsed: $(( $(date +%s) - START )) s"
} | tee "$OUT/summary.txt"

[ $TESTS_RC -eq 0 ] && [ $BENCH_RC -eq 0 ]
