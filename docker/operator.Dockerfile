# The operator image: harvest-operator alone.
# Built by scripts/images.sh from a context it prepares (bin/ from the project's own build).
ARG BASE=gcr.io/distroless/cc-debian12:nonroot
FROM ${BASE}
COPY bin/harvest-operator /usr/local/bin/harvest-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/harvest-operator"]
