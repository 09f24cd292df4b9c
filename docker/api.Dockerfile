# The REST API image.
# UNBUILT: no Docker engine runs where this project is developed; build it in your CI.
#   docker build -f docker/api.Dockerfile -t ghcr.io/harvest-dev/harvest-api:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p harvest-api

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/harvest-api /usr/local/bin/harvest-api
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvest-api"]
