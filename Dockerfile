# The coordinator and the worker agent (with the torch runner), one image for both.
#   docker build -t fleet-controlplane .
# CPU wheels of torch by default; for CUDA pass e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY controlplane ./controlplane
COPY workers ./workers
# verify: model-signing, so workers can check signed checkpoints (FLEET_WORKER_MODEL_TRUST).
RUN pip install --extra-index-url "${TORCH_INDEX}" ".[torch,verify]"

# An unprivileged user; the checkpoints and worker-state volumes start out owned by it.
RUN useradd --create-home --uid 10001 fleet \
    && mkdir -p /checkpoints /var/lib/fleet \
    && chown fleet:fleet /checkpoints /var/lib/fleet
USER fleet
WORKDIR /home/fleet

EXPOSE 8080
# No default command: compose.yaml runs `controlplane coordinator`, `fleet-worker run`, ...
CMD ["controlplane", "--help"]
