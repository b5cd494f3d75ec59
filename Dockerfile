# syntax=docker/dockerfile:1
#
# pacer: multi-stage build. The runtime image holds the binary, CA roots and a
# default config that listens on all interfaces; it runs as an unprivileged user
# (uid 10001, the runAsUser of deploy/kubernetes/base/deployment.yaml).
#
#   docker build -t pacer .
#   docker run --rm -p 9464:9464 -e PACER_REDIS_URL=redis://host.docker.internal:6379 pacer
#   docker run --rm -v $PWD/config.yaml:/etc/pacer/config.yaml:ro pacer check-config --config /etc/pacer/config.yaml

# The toolchain this repo is built and tested with (Cargo.toml rust-version is the floor).
ARG RUST_VERSION=1.95
ARG DEBIAN_SUITE=bookworm

# ---------------------------------------------------------------- build
FROM rust:${RUST_VERSION}-${DEBIAN_SUITE} AS builder
WORKDIR /src
# The Lua scripts are compiled in with include_str!, so the whole tree (minus
# .dockerignore) goes in; cache mounts keep the registry and target between builds.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin pacer \
 && install -D -m 0755 target/release/pacer /out/pacer

# -------------------------------------------------------------- runtime
FROM debian:${DEBIAN_SUITE}-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pacer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin pacer
COPY --from=builder /out/pacer /usr/local/bin/pacer
# Same as the Kubernetes base: metrics on 0.0.0.0:9464, Redis URL from
# PACER_REDIS_URL. Mount your own at /etc/pacer/config.yaml to change routes.
COPY deploy/kubernetes/base/config.yaml /etc/pacer/config.yaml
ENV PACER_CONFIG=/etc/pacer/config.yaml \
    RUST_LOG=info,redis=error
USER 10001:10001
# /metrics, /healthz, /readyz
EXPOSE 9464
# SIGTERM drains within worker.drain and exits 0; give `docker stop` more time
# than that (docker stop -t 30).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/pacer"]
CMD ["run", "--config", "/etc/pacer/config.yaml", "--log-format", "json"]
