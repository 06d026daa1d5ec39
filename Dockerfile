# syntax=docker/dockerfile:1
#
# attnscope: one uvicorn worker (one resident model copy) per container.
#
#   CPU (default):  docker build -t attnscope:cpu .
#   CUDA:           docker build -t attnscope:cuda --build-arg TORCH_VARIANT=cu128 .
#                   docker run --gpus all -e ATTNSCOPE_DEVICE=cuda -p 8000:8000 attnscope:cuda
#
# TORCH_VARIANT picks the PyTorch wheel index (https://download.pytorch.org/whl/<variant>):
# "cpu" or a CUDA tag published for torch 2.13.0 (e.g. cu126, cu128). The CUDA wheels bring
# their own CUDA runtime libraries; the host needs only the NVIDIA driver and the NVIDIA
# container toolkit. Model weights are cached under HF_HOME, a volume: mount it to keep them
# across containers (docker-compose.yml does).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/hf \
    ATTNSCOPE_HOST=0.0.0.0 \
    ATTNSCOPE_PORT=8000 \
    ATTNSCOPE_LOG_FORMAT=json

WORKDIR /app

# 1. Dependencies (cached until pyproject.toml changes): torch first from the chosen index, then
#    the project's own dependency list read from pyproject.toml (the single source of truth).
COPY pyproject.toml ./
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}" \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__" \
    && rm /tmp/requirements.txt

# 2. The code (changes often; only this layer is rebuilt).
COPY README.md ./
COPY schemas ./schemas
COPY service ./service
COPY clients/python/attnscope/client ./clients/python/attnscope/client
RUN pip install --no-deps . \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /app attnscope \
    && mkdir -p /data/hf \
    && chown -R 10001:10001 /data/hf

USER 10001:10001
VOLUME ["/data/hf"]
EXPOSE 8000

# Ready = model loaded and its probe forward passed (python, since the slim image has no curl).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-m", "attnscope.service.healthcheck"]

# uvicorn finishes in-flight requests on SIGTERM (up to 30 s): give the container a stop
# timeout above that (docker run --stop-timeout 40; compose stop_grace_period: 40s).
STOPSIGNAL SIGTERM
CMD ["attnscope", "serve", "--host", "0.0.0.0"]
