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

# The source tree, not an installed copy: the tests check this checkout's client.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" -m pytest -p no:cacheprovider "$@"
