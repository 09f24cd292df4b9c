# syntax=docker/dockerfile:1
# The worker image: the harvester binary on the CUDA 13 runtime (cuBLAS and NVRTC; the driver,
# libcuda, comes from the node through the NVIDIA container toolkit). The binary loads CUDA at
# run time (cudarc's dynamic loading), so the build stage needs no CUDA toolkit, and the same
# image runs on CPU-only nodes with --device cpu (or auto). Models come from the image (COPY a
# checkpoint into /models) or a mounted volume, at the path the operator's catalogue names.
# UNBUILT: no Docker engine runs where this project is developed; build it in your CI.
#   docker build -f docker/harvester.Dockerfile -t ghcr.io/harvest-dev/harvester:0.1.0 .
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

FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/harvester /usr/local/bin/harvester
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvester"]
