# The worker image: the harvester binary, and cuBLAS and NVRTC of CUDA 13 and of CUDA 12 from
# NVIDIA's own Python wheels (the versions CI compiles and resolves against, scripts/test-tools.sh).
# The driver (libcuda) comes from the node through the NVIDIA container toolkit; the harvester
# loads the libraries of the major that driver runs (13 on drivers 580 and newer, 12 on 535 to
# 575), so no CUDA base image pins the node's driver. `harvester cuda-info` says which it loaded.
# The binary loads CUDA at run time, so the build stage needs no CUDA toolkit, and the same
# image runs on CPU-only nodes with --device cpu (or auto). Models come from the image (COPY a
# checkpoint into /models) or a mounted volume, at the path the operator's catalogue names.
# Compiled kernels are cached in /tmp (an emptyDir under a read-only root); a cache that cannot
# be written is skipped with a warning.
# UNBUILT: no Docker engine runs where this project is developed; build it in your CI.
#   docker build -f docker/harvester.Dockerfile -t ghcr.io/harvest-dev/harvester:0.1.0 .
ARG BASE=debian:bookworm-slim

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The registry and the target directory are BuildKit caches: a rebuild after a source change
# recompiles the workspace crates, not the dependencies. The cache is not part of the image, so
# the binary is copied out of it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p harvester && \
    mkdir -p /out && cp target/release/harvester /out/

# NVIDIA's wheels, unpacked: CUDA 13's into nvidia/cu13/lib, CUDA 12's into nvidia/cublas/lib and
# nvidia/cuda_nvrtc/lib, where the harvester's library search looks under a site-packages folder.
FROM python:3.12-slim-bookworm AS cuda
RUN pip install --no-cache-dir --no-deps --target /opt/harvest/cuda \
    nvidia-cublas==13.10.0.20 nvidia-cuda-nvrtc==13.5.37 \
    nvidia-cublas-cu12==12.9.3.13 nvidia-cuda-nvrtc-cu12==12.9.86 && \
    rm -rf /opt/harvest/cuda/nvidia/*/include /opt/harvest/cuda/*.dist-info

FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=cuda /opt/harvest/cuda /opt/harvest/cuda
COPY --from=build /out/harvester /usr/local/bin/harvester
ENV HARVEST_CUDA_LIBRARY_PATH=/opt/harvest/cuda \
    HARVEST_KERNEL_CACHE=/tmp/harvest-kernels \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvester"]
