# mini-infer for a Ray cluster: this repository at /app with its .venv (scripts/setup.sh), the
# C++ CPU attention kernel built and the default model converted at build time.
#   docker build -t mini-infer:latest .                          # CPU torch
#   docker build -t mini-infer:latest --build-arg DEVICE=cuda .  # PyPI's CUDA torch (bundles
#                                                                # CUDA; the node needs the driver)
# ray_configs/kuberay_rayservice.yaml names this image; tests/test_deployment_files.py checks
# that the two and the Serve configs agree on paths, ports and the import path.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# cpu or cuda: which torch build scripts/setup.sh finds first.
ARG DEVICE=cpu
# g++ builds the C++ CPU attention kernel; gcc, libc6-dev and the image's Python headers let
# Triton compile its launcher on GPU nodes (docs/DEPLOYMENT.md, "GPU nodes").
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# RAY_SERVE_PROXY_USE_GRPC: Serve's proxy calls the ingress over gRPC; the two RUN_ settings:
# user code and handles' routing on each replica's own event loop (docs/DEPLOYMENT.md)
ENV MINI_INFER_CACHE=/app/.model-cache \
    TORCH_EXTENSIONS_DIR=/app/.cache/torch_extensions \
    RAY_SERVE_PROXY_USE_GRPC=1 \
    RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 \
    RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 \
    PATH=/app/.venv/bin:$PATH

COPY pyproject.toml Makefile README.md ./
COPY scripts scripts
COPY app app
COPY engine engine
COPY kernels kernels
COPY ray_configs ray_configs

RUN python3 -m venv .venv \
    && if [ "$DEVICE" = cpu ]; then \
         .venv/bin/pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu; \
       fi \
    && ./scripts/setup.sh \
    && .venv/bin/python -c "from engine.loader import load_model; load_model('smollm2-135m-instruct')"

# Serve's HTTP proxy, the Ray head's GCS and the dashboard.
EXPOSE 8000 6379 8265
CMD ["serve", "run", "ray_configs/serve_container.yaml"]
