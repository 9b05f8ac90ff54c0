# syntax=docker/dockerfile:1
# One image for both components; the command selects which:
#   vramshare-webhook | vramshare-controller | vramshare status
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# Build stage: resolve and build wheels for vramshare and its dependencies.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY webhook/ webhook/
RUN pip wheel --wheel-dir /wheels .

# Final stage: the wheels installed into a virtualenv, no compilers, no build files, non-root.
FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vramshare" \
      org.opencontainers.image.description="Share NVIDIA GPUs between Kubernetes pods by memory: admission webhook and controller" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://vramshare.io"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/vramshare/bin:$PATH
# The wheels are mounted from the build stage for this one step, so no layer keeps them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/vramshare \
    && /opt/vramshare/bin/pip install --no-index --find-links=/wheels vramshare
USER 65532:65532
EXPOSE 8443 8080
CMD ["vramshare-webhook"]
