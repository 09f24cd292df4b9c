# The operator image.
# UNBUILT: no Docker engine runs where this project is developed; build it in your CI.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/harvest-dev/harvest-operator:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p harvest-operator

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/harvest-operator /usr/local/bin/harvest-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvest-operator"]
