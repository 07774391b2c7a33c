#!/usr/bin/env bash
# The Python client's tests: pytest against real `lockbroker serve` processes (on the embedded
# store and on a redis-server the tests start on a free loopback port).
#
#   clients/python/test.sh [extra pytest arguments...]
#
# The broker binary is $LOCKBROKER_BIN, else the repository's target/debug/lockbroker (build it
# with `cargo build --bin lockbroker`; scripts/test.sh runs this after `cargo test`, which builds
# it). $PYTHON picks the interpreter (default python3, 3.9 or newer). pytest is installed with pip
# when missing; the client itself needs nothing beyond the standard library.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found; the Python client's tests need Python 3.9 or newer." >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))'; then
    echo "error: $("$PYTHON" --version 2>&1) is too old; the Python client needs 3.9 or newer." >&2
    exit 1
fi
if ! "$PYTHON" -c 'import pytest' >/dev/null 2>&1; then
    echo "pytest not found: installing it with pip."
    if ! "$PYTHON" -m pip install --quiet pytest; then
        echo "error: could not install pytest with pip; install it (Debian/Ubuntu: apt-get install python3-pytest;" >&2
        echo "       elsewhere: $PYTHON -m pip install --user pytest), then run this again." >&2
        exit 1
    fi
fi

BIN="${LOCKBROKER_BIN:-$(cd ../.. && pwd)/target/debug/lockbroker}"
if [[ ! -x "$BIN" ]]; then
    echo "error: no lockbroker binary at $BIN; run \`cargo build --bin lockbroker\` first, or set LOCKBROKER_BIN." >&2
    exit 1
fi
export LOCKBROKER_BIN="$BIN"

# Beside the tests: the package installs as users install it (`pip install ./clients/python` in a
# fresh venv; pip fetches setuptools to build it) and both clients import from the installed copy.
# LOCKBROKER_PY_SKIP_INSTALL=1 skips this (no package index reachable).
install_log=""
if [[ "${LOCKBROKER_PY_SKIP_INSTALL:-}" != 1 ]]; then
    venv="$(mktemp -d -t lockbroker-py-venv.XXXXXX)"
    install_log="$venv.log"
    trap 'rm -rf "$venv" "$install_log"' EXIT
    (
        "$PYTHON" -m venv "$venv" &&
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$PWD" &&
            cd "$venv" && "$venv/bin/python" -c \
            'import lockbroker, lockbroker.aio; assert lockbroker.aio.AsyncBroker and lockbroker.Broker'
    ) >"$install_log" 2>&1 &
    install_pid=$!
fi

# The source tree, not an installed copy: the tests check this checkout's client.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
status=0
"$PYTHON" -m pytest -p no:cacheprovider "$@" || status=$?

if [[ -n "$install_log" ]]; then
    if wait "$install_pid"; then
        echo "install check: pip install ./clients/python in a fresh venv, then import lockbroker.aio: ok"
    elif grep -qE "NewConnectionError|Temporary failure in name resolution|Network is unreachable|No matching distribution found for setuptools|Could not fetch URL" "$install_log"; then
        # pip builds the package with setuptools from the index: without one, nothing to check.
        echo "install check skipped: pip could not reach a package index for setuptools (offline?)"
    else
        echo "error: pip install ./clients/python in a fresh venv failed, or the installed package does not import:" >&2
        cat "$install_log" >&2
        echo "(LOCKBROKER_PY_SKIP_INSTALL=1 skips this check where no package index is reachable)" >&2
        status=1
    fi
fi
exit "$status"
