# The worker image: the harvester binary, and cuBLAS, cuBLASLt and NVRTC of CUDA 13 and of CUDA
# 12 from NVIDIA's own Python wheels (the versions CI compiles and resolves against,
# scripts/test-tools.sh). The driver (libcuda) comes from the node through the NVIDIA container
# toolkit; the harvester loads the libraries of the major that driver runs (13 on drivers 580
# and newer, 12 on 535 to 575), so no CUDA base image pins the node's driver. `harvester
# cuda-info` says which it loaded. The same image runs on CPU-only nodes with --device cpu.
# Models come from a mounted volume, at the path the operator's catalogue names. Compiled
# kernels are cached in /tmp (an emptyDir under a read-only root); a cache that cannot be
# written is skipped with a warning.
#
# Built by scripts/images.sh from a context it prepares (bin/ from the project's own build,
# cuda/ from the wheels); no registry is needed when BASE is a local image:
#   scripts/images.sh build                       # BASE: distroless cc, pulled
#   scripts/images.sh build --base harvest-base   # BASE: made offline (scripts/images.sh base)
ARG BASE=gcr.io/distroless/cc-debian12:nonroot
FROM ${BASE}
COPY cuda/ /opt/harvest/cuda/
COPY bin/harvester /usr/local/bin/harvester
ENV HARVEST_CUDA_LIBRARY_PATH=/opt/harvest/cuda \
    HARVEST_KERNEL_CACHE=/tmp/harvest-kernels \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvester"]
