# The SuperLink of a fedvlm federation. It also runs the ServerApp (Flower's default
# `--isolation subprocess`), which loads the method's strategy: the LoRA methods keep the VLM
# on the server's CPU to score the global model, so this image carries the app's dependencies
# with a CPU build of PyTorch (no GPU needed on the server).
#
#   docker build -f docker/superlink.Dockerfile -t fedvlm-superlink .      (from the repository root)
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# CPU wheels of torch/torchvision first, so that the app's own install finds them satisfied
# instead of pulling the multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.15" "torchvision>=0.19,<0.30"

RUN useradd --create-home --uid 10001 app
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fedvlm ./fedvlm
RUN pip install . && mkdir -p /state /home/app/fedvlm-runs && chown app:app /state /home/app/fedvlm-runs

USER app
# The SuperLink's database (runs, registered SuperNode keys) and the ServerApp's outputs
# live on volumes, so a restarted container keeps its federation.
VOLUME ["/state", "/home/app/fedvlm-runs"]
EXPOSE 9093
ENTRYPOINT ["flower-superlink"]
CMD ["--host", "0.0.0.0", "--port", "9093", "--database", "/state/superlink.db", \
     "--ssl-ca-certfile", "/credentials/ca.crt", "--ssl-certfile", "/credentials/server.crt", \
     "--ssl-keyfile", "/credentials/server.key", "--enable-supernode-auth", \
     "--disable-runtime-dependency-installation"]
