# syntax=docker/dockerfile:1
#
# rnnserve GPU image: cuDNN RNN engine on CUDA 13, the CPU reference engine without a GPU.
#
#   docker build -t rnnserve .
#   docker run --gpus all -p 8000:8000 -p 8001:8001 rnnserve                 # serve /models (--device auto)
#   docker run -p 8000:8000 -p 8001:8001 rnnserve                            # same image, CPU reference engine
#   docker run -v "$PWD/my-models:/models" -p 8000:8000 rnnserve             # serve your own repository
#
# Convert models where their framework is installed (`pip install 'rnnserve[torch]'`, or [keras,torch], [onnx]),
# since each conversion is checked against it: the image holds no framework, so it cannot read .pt or
# .keras files, and converts ONNX and safetensors files unchecked ("not verified").
#
# ENTRYPOINT is the bare `rnnserve` command, so the first argument picks the subcommand
# (serve, convert, inspect); CMD is the default `serve` of the baked-in /models.
# Arguments after the image name replace the whole CMD: `docker run IMAGE serve --device cpu`.
#
# The CUDA runtime comes from the base image; cuDNN 9 and CuPy come from their wheels
# (the `gpu` extra: nvidia-cudnn-cu13, cupy-cuda13x), so the host only needs the NVIDIA
# driver and the container toolkit. The builder and the final stage share one base so
# the virtualenv's interpreter (Ubuntu 24.04's python3.12) is the same in both.

ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS builder

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Ubuntu's python3 and its venv module; every dependency ships manylinux wheels.
# gcc and the Python headers compile the reference engine's LSTM kernel into the
# rnnserve wheel (optional: without them the CPU engine falls back to NumPy, 2-3x
# slower on LSTMs); only the builder has them, the final stage gets the built wheel.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY service ./service

# Build the rnnserve wheel, then install it with the GPU extra (cuDNN 9 + CuPy wheels)
# into /opt/venv, the only thing the final stage takes from this one.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir "$(ls /wheels/rnnserve-*.whl)[gpu]"

# Fail the build, not the first deployment, when the console script or an import is broken.
RUN rnnserve --version


FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="rnnserve" \
      org.opencontainers.image.description="LSTM/GRU/RNN inference server: cuDNN RNN engine, Open Inference Protocol over REST and gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

# Only the interpreter: no pip, no compilers, no test dependencies.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 rnnserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/rnnserve --create-home \
       --shell /usr/sbin/nologin rnnserve

COPY --from=builder /opt/venv /opt/venv

# The bundled example repository. Mount your own over it (-v DIR:/models); a named
# volume starts as a copy of these models.
COPY --chown=10001:10001 models/ /models/
VOLUME ["/models"]

# From /, `rnnserve convert` and `rnnserve serve` default to ./models, which is /models.
WORKDIR /
# Numeric user so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001

EXPOSE 8000 8001

# Readiness on the HTTP port (RNNSERVE_HTTP_PORT when set, like the server); no curl needed.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; port = os.environ.get('RNNSERVE_HTTP_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/v2/health/ready', timeout=4).status == 200 else 1)"]

# The serve defaults as variables, not CMD flags: a flag would override `docker run -e RNNSERVE_DEVICE=cpu`.
ENV RNNSERVE_REPOSITORY=/models \
    RNNSERVE_DEVICE=auto

# Exec form: rnnserve is PID 1 and gets SIGTERM itself; it stops accepting requests,
# drains the in-flight batches and exits 0. Give it time: docker run --stop-timeout 40 (the
# drain timeout, 30 s, plus a margin; with --frontends or --engines twice the drain timeout).
STOPSIGNAL SIGTERM
ENTRYPOINT ["rnnserve"]
CMD ["serve"]
