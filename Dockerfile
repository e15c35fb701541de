# meshforge training image: the official PyTorch CUDA runtime image (Python, torch, CUDA,
# cuDNN and NCCL) plus meshforge installed from this source tree.
#
#   make image                      # docker build -t meshforge:<version> .
#   make image IMAGE=registry.example.com/team/meshforge:0.1.0
#
# Every node of a job must run the same bits. The tag below is pinned (never `latest`); for a
# build that cannot drift, pin the base by digest too:
#   FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime@sha256:<digest>
# (`docker buildx imagetools inspect pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime` prints it),
# and after pushing, hand the cluster the image by its own digest:
#   docker inspect --format '{{index .RepoDigests 0}}' registry.example.com/team/meshforge:0.1.0
#
# NCCL is configured at run time, per cluster, not baked in: NCCL_DEBUG=WARN (INFO to see the
# rings, transports and interfaces NCCL chose), NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to pick
# the network interface. `meshforge submit k8s` sets them (`--iface`); give the container a
# memory-backed /dev/shm larger than the 64 MiB default (`docker run --shm-size=8g`,
# or the emptyDir the Kubernetes manifests mount).
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/meshforge
COPY pyproject.toml README.md ./
COPY src ./src
# torch comes from the base image (it satisfies torch>=2.6), so pip adds only meshforge and
# its pure-Python dependencies; the CLI is checked while building.
RUN pip install --no-cache-dir . && meshforge --help > /dev/null

# Jobs run as an unprivileged user, never root (uid/gid 1000: `meshforge submit k8s` runs
# its pods as this uid with runAsNonRoot and a read-only root filesystem). It owns only its
# home (caches) and /workspace; the installed code stays root's and read-only to it. (Ubuntu
# 24.04 bases ship a user `ubuntu` with uid 1000: it goes.)
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 meshforge \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/meshforge \
       --shell /usr/sbin/nologin meshforge \
    && mkdir -p /workspace && chown meshforge:meshforge /workspace

# Relative run directories (runs/NAME) land here; mount shared storage at /workspace/runs.
WORKDIR /workspace
USER 1000:1000
ENTRYPOINT ["meshforge"]
CMD ["--help"]
