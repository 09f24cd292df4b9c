# syntax=docker/dockerfile:1
# The REST API image.
# UNBUILT: no Docker engine runs where this project is developed; build it in your CI.
#   docker build -f docker/api.Dockerfile -t ghcr.io/harvest-dev/harvest-api:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The registry and the target directory are BuildKit caches: a rebuild after a source change
# recompiles the workspace crates, not the dependencies. The cache is not part of the image, so
# the binary is copied out of it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p harvest-api && \
    mkdir -p /out && cp target/release/harvest-api /out/

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/harvest-api /usr/local/bin/harvest-api
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvest-api"]
