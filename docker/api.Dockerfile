# The REST API image: harvest-api alone. On Kubernetes it drives HarvestJobs; as the embedded
# backend it runs the harvester beside it (mount the worker image's binary, docs/install.md).
# Built by scripts/images.sh from a context it prepares (bin/ from the project's own build).
ARG BASE=gcr.io/distroless/cc-debian12:nonroot
FROM ${BASE}
COPY bin/harvest-api /usr/local/bin/harvest-api
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvest-api"]
