#!/usr/bin/env bash
# The lockbroker test command: the README names it and CI (.ci/run) calls it.
#
#   scripts/test.sh [extra cargo test arguments...]
#
# The integration tests start their own redis-server processes on free loopback ports, and the
# clock-skew tests (tests/safety) run brokers under `faketime`, so this script only makes sure
# `redis-server` and `faketime` are installed (on Debian/Ubuntu it installs them with apt) and then
# runs `cargo test --workspace --all-targets`: the root package's unit tests and its api, cli,
# client, safety and topologies suites, the unit tests of the workspace's other crates
# (core/ and redis-store/, the broker's crates with the lock service's and the stores' unit
# tests; clients/rust, the lockbroker-client crate; cli-support/; test-support/, which holds the
# suites' fixtures), and bench/'s (lockbroker-bench) unit tests and suite;
# then each client library's tests against the broker binary that built, which need a JDK (11+)
# and python3 (3.9+) with pytest (installed with apt too when missing). Extra arguments go to
# `cargo test` only: the Java and Python suites always run in full. It never starts a Redis
# server itself.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${CI:-}" == "true" ]]; then
    export CARGO_TERM_COLOR=never
fi

# apt_install PACKAGE...: installs Debian packages, with sudo when not root.
apt_install() {
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=(sudo)
        else
            echo "error: $* missing, and installing needs root (no sudo here)." >&2
            echo "       Run as root: apt-get update && apt-get install -y $*" >&2
            exit 1
        fi
    fi
    ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update
    ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}

install_redis_server() {
    if command -v apt-get >/dev/null 2>&1; then
        echo "redis-server not found: installing it with apt-get (the tests start their own servers)."
        apt_install redis-server
    else
        cat >&2 <<'MSG'
error: redis-server is not on PATH, and the integration tests need it (they start their own
servers on free loopback ports; nothing needs to be running). Install it, then run this again:
  macOS (Homebrew):       brew install redis
  Fedora / RHEL / CentOS: sudo dnf install redis
  Arch Linux:             sudo pacman -S redis      (or valkey, which provides redis-server)
  Alpine:                 sudo apk add redis
  openSUSE:               sudo zypper install redis
  Nix:                    nix-env -iA nixpkgs.redis
MSG
        exit 1
    fi
}

if ! command -v redis-server >/dev/null 2>&1; then
    install_redis_server
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "error: redis-server is still not on PATH after installing it." >&2
        exit 1
    fi
fi

echo "Using $(command -v redis-server): $(redis-server --version)"

# The clock-skew tests run brokers with their host clock shifted by libfaketime's `faketime`.
if ! command -v faketime >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "faketime not found: installing it with apt-get (the clock-skew tests run brokers under it)."
        apt_install faketime
    else
        cat >&2 <<'MSG'
error: faketime is not on PATH, and the clock-skew tests (tests/safety) run brokers under it.
Install libfaketime, then run this again:
  macOS (Homebrew):       brew install libfaketime
  Fedora / RHEL / CentOS: sudo dnf install libfaketime
  Arch Linux:             sudo pacman -S libfaketime
  Alpine:                 sudo apk add libfaketime
MSG
        exit 1
    fi
    if ! command -v faketime >/dev/null 2>&1; then
        echo "error: faketime is still not on PATH after installing it." >&2
        exit 1
    fi
fi
echo "Using $(command -v faketime)"

cargo test --workspace --all-targets "$@"

# --- Java client (clients/java) ------------------------------------------------------------
# Its tests run against the broker binary `cargo test` has just built, on the embedded store and
# on a redis-server they start themselves; they need a JDK (11+).
if ! command -v javac >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "javac not found: installing default-jdk-headless with apt-get (the Java client's tests need it)."
        apt_install default-jdk-headless
    else
        echo "error: javac (a JDK 11 or later) is not on PATH, and the Java client's tests need it." >&2
        exit 1
    fi
fi
LOCKBROKER_BIN="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/lockbroker" clients/java/test.sh

# --- Python client (clients/python) ----------------------------------------------------------
# Its pytest suite runs against the same broker binary, on the embedded store and on a
# redis-server it starts itself; it needs python3 (3.9+) and installs pytest with pip if missing.
if ! command -v python3 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "python3 not found: installing python3 and python3-pytest with apt-get (the Python client's tests need them)."
        apt_install python3 python3-pytest
    else
        echo "error: python3 (3.9 or later) is not on PATH, and the Python client's tests need it." >&2
        echo "       macOS: brew install python; Fedora/RHEL: dnf install python3; Arch: pacman -S python; Alpine: apk add python3" >&2
        exit 1
    fi
fi
# A python3 without pytest (Debian's own): its package, since pip may not be there, and Debian's
# python3 refuses a system-wide pip install.
if ! python3 -c 'import pytest' >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "pytest not found: installing python3-pytest with apt-get (the Python client's tests need it)."
    apt_install python3-pytest
fi
LOCKBROKER_BIN="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/lockbroker" clients/python/test.sh
