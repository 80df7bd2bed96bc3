# JoyNexus: one image for every role (scheduler, gateway, sim / actor / infer / tracker workers).
# It is the README's own set-up — `make setup` (scripts/install_system.sh, the venv, scripts/constraints.txt,
# setup.cfg) — run in a Debian bookworm Python 3.11, so the image holds exactly the pins the tests run with.
#
#   docker build -t joynexus:0.1.0 .                                  # CPU torch (the default)
#   docker build -t joynexus:0.1.0-cu128 --build-arg TORCH_VARIANT=cu128 .   # a CUDA torch build
#
# deploy/kubernetes/nexus.yaml and deploy/slurm/nexus.sbatch run this image (tests/test_deploy_manifests.py
# checks that they agree with it: the `nexus` command, the ports, the root and scratch paths, the user).
FROM python:3.11-slim-bookworm

# which torch wheel `make setup` installs: cpu, or a CUDA build of the same version (cu126, cu128, ...)
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}

# make runs the set-up; install_system.sh adds the rest (software Vulkan for ManiSkill on CPU, chromium)
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/joynexus
COPY . .
RUN make setup PY=python3.11 TORCH_INDEX=${TORCH_INDEX} \
 && rm -rf /root/.cache/pip /var/lib/apt/lists/*
ENV PATH=/opt/joynexus/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# the deployments run as uid 1000 (the service root is 0700, one user owns it); /nexus holds the shared
# service root (a ReadWriteMany volume on Kubernetes), /scratch the node's own disk
RUN groupadd -g 1000 nexus && useradd -u 1000 -g 1000 -m -s /bin/bash nexus \
 && mkdir -p /nexus /scratch && chown 1000:1000 /nexus /scratch
USER 1000:1000
VOLUME ["/nexus", "/scratch"]

# the Dask scheduler, its dashboard (/health), the tenant gateway (nexus.deploy.hosts's defaults; the gateway's
# port is the one the deployments pass with --port)
EXPOSE 8786 8787 8000
ENTRYPOINT ["nexus"]
CMD ["--help"]
