# syntax=docker/dockerfile:1
# One image for both components; the command selects which:
#   vramshare-webhook | vramshare-controller | vramshare status
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# Build stage: resolve and build wheels for vramshare and its dependencies.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The dependencies first, from pyproject.toml alone: a layer that a change to the code leaves cached.
COPY pyproject.toml ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
    && pip wheel --wheel-dir /wheels -r /tmp/requirements.txt
COPY README.md ./
COPY operator/ operator/
COPY webhook/ webhook/
# The digest of the sources (e2e/tools/build-image.sh passes it) makes this step as fresh as the final
# stage's: buildah once mounted an empty /wheels into a final step built anew from this stage reused
# from its cache (the sources unchanged, their digest not).
ARG SOURCE_DIGEST=""
RUN echo "sources ${SOURCE_DIGEST:-unknown}" > /wheels.sources && pip wheel --no-deps --wheel-dir /wheels .

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
# Buildah (make image) reuses this step's cached layer whatever the mount below brings: the digest of
# the sources (e2e/tools/build-image.sh passes it) changes the step whenever they change.
ARG SOURCE_DIGEST=""
# The wheels are mounted from the build stage for this one step, so no layer keeps them. The user
# gets a name: getpass.getuser() (kopf, among others) fails for a uid missing from /etc/passwd.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/vramshare \
    && /opt/vramshare/bin/pip install --no-index --find-links=/wheels vramshare \
    && echo "vramshare:x:65532:65532:vramshare:/nonexistent:/usr/sbin/nologin" >> /etc/passwd \
    && echo "vramshare:x:65532:" >> /etc/group \
    && echo "sources ${SOURCE_DIGEST:-unknown}" > /opt/vramshare/SOURCE_DIGEST
USER 65532:65532
EXPOSE 8443 8080
CMD ["vramshare-webhook"]
