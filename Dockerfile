# The dflash-serve image. `docker run` starts `dflash serve` on a config file; under KubeRay (the
# Helm chart) the operator replaces the command with `ray start` and the same code runs as a
# Ray Serve application.
#
#   docker build -t REGISTRY/dflash-serve:0.1.0 .
#   docker run --gpus all -p 9000:9000 -v "$PWD/serve.yaml:/etc/dflash/config.yaml:ro" REGISTRY/dflash-serve:0.1.0
#
# torch 2.11.0 from PyPI is built against CUDA 13.0, hence this base.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

# Python 3.12; a C compiler and Python headers, which Triton needs at run time to build its GPU
# launchers; bash and wget, which KubeRay's probes and init container call; tini, PID 1 under
# `docker run`: it reaps the processes orphaned to it (an engine process whose replica died and that
# nobody adopted, Ray's workers) and passes SIGTERM on to `dflash serve`.
# Ubuntu's archive drops superseded package versions, so exact apt pins would break rebuilds:
# the base image tag pins the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev wget ca-certificates tini \
    && rm -rf /var/lib/apt/lists/*

# The user the chart's securityContext runs as (a high uid, clear of the host's users).
RUN groupadd --gid 10001 dflash \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/dflash --shell /bin/bash dflash

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Third-party dependencies in their own layer, before any source is copied: code changes do not
# rebuild it. These pins satisfy pyproject.toml's ranges (tests/helm/test_dockerfile.py checks).
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir \
        torch==2.11.0 \
        "ray[serve]==2.60.0" \
        transformers==5.17.0 \
        huggingface-hub==1.33.0 \
        safetensors==0.8.0 \
        tokenizers==0.23.3 \
        tqdm==4.70.1 \
        grpcio==1.85.1 \
        protobuf==6.33.6 \
        grpcio-health-checking==1.76.0 \
        grpcio-reflection==1.81.1 \
        pyyaml==6.0.3 \
        pydantic==2.14.4 \
        pydantic-settings==2.16.3 \
        jinja2==3.1.6 \
        gguf==0.19.0 \
        accelerate==1.15.0 \
        matplotlib==3.11.2 \
        aiohttp==3.14.5 \
        httpx==0.28.1 \
        prometheus-client==0.26.0

# The project itself, with its committed gRPC stubs (services/api): the Serve proxy imports them
# from the image, outside any runtime env. --no-deps: everything it needs is pinned above, and
# pip check fails the build if that stops being true.
WORKDIR /opt/dflash-serve
COPY pyproject.toml README.md ./
COPY kernels/ kernels/
COPY protos/ protos/
COPY services/ services/
RUN pip install --no-cache-dir --no-deps . \
    && pip check \
    && python -c "import dflash_serve.services.api.dflash.v1.generation_pb2_grpc, grpc_health.v1.health_pb2_grpc"

USER 10001:10001
WORKDIR /home/dflash
# gRPC (dflash.v1.Generation), Serve HTTP, metrics, Ray dashboard.
EXPOSE 9000 8000 8080 8265

# Healthy once the router answers grpc.health.v1 Check with SERVING (model loading takes minutes).
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:9000')).Check(h.HealthCheckRequest(), timeout=5); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]

ENTRYPOINT ["tini", "--", "dflash", "serve"]
CMD ["--config", "/etc/dflash/config.yaml"]
