# syntax=docker/dockerfile:1
#
# lockbroker container image: the broker, and the benchmark beside it (lockbroker-bench).
#
#   docker build -t lockbroker .
#   docker run --rm -p 8080:8080 -e LOCKBROKER_REDIS_URL=redis://redis-host:6379 lockbroker
#
# Without LOCKBROKER_REDIS_URL the broker runs on its embedded in-memory store, which is correct
# for one broker only (it says so loudly at start). deploy/compose.yaml runs three brokers on
# one Redis behind nginx.

############################ build ############################
FROM rust:1-slim-bookworm AS builder
WORKDIR /build

# make: the jemalloc allocator (tikv-jemalloc-sys) builds its C library with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

# 1. Dependencies only, cached until a manifest or Cargo.lock changes: build the real
#    manifests against stub sources. Cargo loads the whole workspace to resolve it, so every
#    member's manifest is copied (the broker; core/ and redis-store/, the crates it is built
#    from; clients/rust, the client crate it builds on;
#    cli-support/, what the broker's and the bench's command lines share; bench/, the
#    benchmark; test-support/, the suites' fixtures, a dev-dependency never built here;
#    model/, the checked model of the store protocol, never built here). A
#    member added to the workspace without a line here fails this step, and CI
#    (scripts/container-check.sh) builds this image on every run. Every target path a manifest
#    names (lib, bins, and any [[test]]/[[bench]]/[[example]] entries) gets a stub (`main.rs`
#    an empty `main`), so cargo can read the manifest whatever targets it declares; only the
#    two binaries, `lockbroker` and `lockbroker-bench`, and their dependencies are built.
COPY Cargo.toml Cargo.lock ./
COPY core/Cargo.toml ./core/
COPY redis-store/Cargo.toml ./redis-store/
COPY clients/rust/Cargo.toml ./clients/rust/
COPY cli-support/Cargo.toml ./cli-support/
COPY bench/Cargo.toml ./bench/
COPY test-support/Cargo.toml ./test-support/
COPY model/Cargo.toml ./model/
RUN set -eu; \
    members=$(sed -n '/^members *=/,/]/p' Cargo.toml | grep -o '"[^"]*"' | tr -d '"'); \
    for m in $members; do \
        [ -f "$m/Cargo.toml" ] || { echo "workspace member $m: its Cargo.toml is not copied (Dockerfile, step 1)" >&2; exit 1; }; \
        for p in $(sed -n 's/^[[:space:]]*path[[:space:]]*=[[:space:]]*"\([^"]*\.rs\)".*/\1/p' "$m/Cargo.toml") src/lib.rs; do \
            mkdir -p "$(dirname "$m/$p")"; \
            case "$p" in \
                *main.rs) stub='fn main() {}' ;; \
                *) stub='' ;; \
            esac; \
            [ -e "$m/$p" ] || echo "$stub" > "$m/$p"; \
        done; \
    done; \
    echo 'fn main() {}' > src/main.rs; \
    cargo build --release --locked -p lockbroker -p lockbroker-bench --bins; \
    rm -rf src tests benches examples core/src redis-store/src clients/rust/src cli-support/src bench/src

# 2. The real sources. Touch them so cargo sees them as newer than the stub build (COPY keeps
#    the files' own modification times, which may be older), then build both binaries in one
#    run (one build of the library serves both).
COPY src ./src
COPY core/src ./core/src
COPY redis-store/src ./redis-store/src
COPY clients/rust/src ./clients/rust/src
COPY cli-support/src ./cli-support/src
COPY bench/src ./bench/src
COPY config ./config
RUN set -eu; \
    find src core/src redis-store/src clients/rust/src cli-support/src bench/src -name '*.rs' -exec touch {} +; \
    cargo build --release --locked -p lockbroker -p lockbroker-bench --bins; \
    install -D -m 0755 target/release/lockbroker /out/lockbroker; \
    install -D -m 0755 target/release/lockbroker-bench /out/lockbroker-bench

############################ run ############################
FROM debian:bookworm-slim AS runtime

# curl is for the HEALTHCHECK below; ca-certificates for a rediss:// URL later.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid, and USER by number, so that Kubernetes' runAsNonRoot can verify the
# user is not root (it cannot for a user given by name) and manifests can name the same id.
RUN groupadd --system --gid 10001 lockbroker \
    && useradd --system --uid 10001 --gid lockbroker --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin lockbroker

COPY --from=builder /out/lockbroker /usr/local/bin/lockbroker
# The benchmark, to load a broker from inside its network: `lockbroker-bench --url …`.
COPY --from=builder /out/lockbroker-bench /usr/local/bin/lockbroker-bench
# The documented configuration file, for reference and for --config; not read by default.
COPY config/lockbroker.toml /etc/lockbroker/lockbroker.toml

USER 10001:10001

# In a container the broker must listen on every interface. (Environment beats a config
# file, and a --listen flag beats both.)
ENV LOCKBROKER_LISTEN=0.0.0.0:8080
EXPOSE 8080

# /healthz answers 200 while the process serves; /readyz also checks the store. If you move
# the port with LOCKBROKER_LISTEN, override this healthcheck too.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD curl -fsS --max-time 2 http://127.0.0.1:8080/healthz || exit 1

# SIGTERM (docker stop) shuts down gracefully: stop accepting, waiting acquires get 503
# shutting_down, in-flight requests finish, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["lockbroker"]
CMD ["serve"]
