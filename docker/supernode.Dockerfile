# A SuperNode of a fedvlm federation: the organisation's machine. Its ClientApps hold the
# private prompts/LoRA halves and train, on the GPU when one is present, so the default base
# is PyTorch's CUDA runtime image (it runs on the CPU as well when no GPU is given to the
# container). For a CPU-only machine, a smaller image:
#
#   docker build -f docker/supernode.Dockerfile -t fedvlm-supernode .                      (GPU-capable)
#   docker build -f docker/supernode.Dockerfile --build-arg BASE_IMAGE=python:3.11-slim \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t fedvlm-supernode:cpu .
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# The CUDA base already has torch; a CPU base gets it from TORCH_INDEX.
RUN if [ -n "$TORCH_INDEX" ]; then \
      pip install --index-url "$TORCH_INDEX" "torch>=2.4,<2.15" "torchvision>=0.19,<0.30"; \
    fi

RUN useradd --create-home --uid 10001 app
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fedvlm ./fedvlm
RUN pip install . && mkdir -p /data /home/app/.cache/fedvlm && chown -R app:app /home/app/.cache

USER app
# /data: the organisation's own images (read-only); the cache holds pretrained weights and
# encoded features between rounds and restarts.
VOLUME ["/home/app/.cache/fedvlm"]
ENTRYPOINT ["flower-supernode"]
# The SuperLink address, the CA certificate, the node's private key and its node config are
# given per organisation (see docker/compose.yml and docs/deployment.md).
CMD ["--help"]
