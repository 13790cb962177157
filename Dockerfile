# The image the Helm chart runs (helm/resilient: coordinator, workers, test pod).
#   docker build -t resilient-collectives:0.1.0 .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t resilient-collectives:0.1.0-cuda .
# Non-root (uid 1000, as the chart's podSecurityContext), and nothing written outside /tmp
# and /dev/shm at run time (the chart mounts both as emptyDirs under a read-only root).
# Put your training script at /workspace/train.py (the chart's default command), e.g.
#   FROM resilient-collectives:0.1.0
#   COPY train.py /workspace/train.py
FROM python:3.11-slim

# torch first and pinned: the CPU build by default; a CUDA build from TORCH_INDEX
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TMPDIR=/tmp \
    HOME=/tmp

# a C compiler for the two optional kernels (kernels/*.c), removed after the build
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
 && pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/resilient
COPY pyproject.toml setup.py README.md LICENSE ./
COPY resilient ./resilient
COPY coordinator ./coordinator
COPY kernels ./kernels
COPY chaos ./chaos
RUN pip install . \
 && apt-get purge -y -qq gcc libc6-dev && apt-get autoremove -y -qq \
 && groupadd --gid 1000 resilient && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp resilient \
 && mkdir -p /workspace && chown 1000:1000 /workspace

USER 1000
WORKDIR /workspace
ENTRYPOINT []
CMD ["resilient-run", "--help"]
