#!/usr/bin/env bash
# A container engine for the image and compose checks (scripts/container-check.sh,
# scripts/container-failover.sh): runs the container setup kept beside the checkout (../shared/tools/containers/setup.sh
# from the checkout: podman with its Docker-compatible API, docker-compose, and local stand-ins
# for the base images, since no image registry is reachable) after one fix of its own:
# on a host whose cgroups are mounted in hybrid mode (v1 controllers plus a cgroup2 tree at
# /sys/fs/cgroup/unified) crun refuses every container ("cgroups in hybrid mode not supported"),
# so podman is told to use runc there. Idempotent; needs root. Prints the DOCKER_HOST to use.
#
#   scripts/containers.sh && export DOCKER_HOST=unix:///run/lockbroker-podman.sock
#
# `--restart` stops the engine's API service first, so that the setup starts it anew.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

setup=../shared/tools/containers/setup.sh
if [[ ! -f "$setup" ]]; then
    echo "error: $setup is missing: it installs the container engine and the base images' stand-ins." >&2
    exit 1
fi
if [[ "$(id -u)" -ne 0 ]]; then
    echo "error: the container engine's setup needs root." >&2
    exit 1
fi

conf=/etc/containers/containers.conf
if mountpoint -q /sys/fs/cgroup/unified 2>/dev/null && ! grep -q '^runtime *= *"runc"' "$conf" 2>/dev/null; then
    echo "cgroups in hybrid mode: podman runs containers with runc"
    command -v runc >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null; }
    mkdir -p /etc/containers
    if [[ ! -f "$conf" ]]; then
        # setup.sh writes this section only when the file is missing.
        printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=30000:30000"]\n' >"$conf"
    fi
    if grep -q '^\[engine\]' "$conf"; then
        sed -i 's/^\[engine\]$/[engine]\nruntime = "runc"/' "$conf"
    else
        printf '\n[engine]\nruntime = "runc"\n' >>"$conf"
    fi
fi
# The engine's API service does not outlive the session that started it, but its socket file
# does, and the setup starts the service only when the socket is missing.
sock=/run/lockbroker-podman.sock
if [[ ${1:-} == --restart ]]; then
    pkill -f "podman system service.*$sock" || true
    rm -f "$sock"
fi
if [[ -S "$sock" ]] && ! curl -s --max-time 5 --unix-socket "$sock" http://engine/_ping >/dev/null; then
    rm -f "$sock"
fi
bash "$setup"
