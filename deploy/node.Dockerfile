# The node image for real deployments (a Python base image plus the package):
#   docker build -f deploy/node.Dockerfile -t mvp-orchestrator-node:latest .
# then give runs "worker_image": "mvp-orchestrator-node:latest" (pushed where the
# provider's daemon can pull it). Without worker_image, the Docker provider builds an
# offline host image instead (docs/docker.md). GPU hosts: use the CUDA build of torch
# (drop the --index-url line) and set the run's docker.gpus.
FROM python:3.11-slim
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /opt/mvp-orchestrator
COPY pyproject.toml README.md ./
COPY mvp_core mvp_core
COPY mvp_io mvp_io
COPY workflows workflows
COPY activities activities
COPY workers workers
COPY temporal temporal
RUN pip install --no-cache-dir .
# The provider runs `<mvp.python> -m workers.node --resource=<name>` in the node directory.
LABEL mvp.created-by=mvp-orchestrator mvp.python=python
WORKDIR /var/lib/mvp/node
CMD ["python", "-m", "workers.node"]
