#!/usr/bin/env bash
# The exhaustive check of the store protocol's model (model/, docs/model.md): builds the
# checker (release profile) and explores every reachable state of each bounded configuration,
# printing `N states` and each property's verdict. Exits non-zero, with a counterexample trace
# (each step's action and the state after it), when a property fails.
#
#   scripts/model-check.sh                 the protocol as the scripts are (CI runs this)
#   scripts/model-check.sh --list-bugs     the known-bad variants of the model
#   scripts/model-check.sh --bug NAME      checks one of them: it must fail
#   scripts/model-check.sh --threads N     checker threads (default 2)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --quiet --release --locked -p lockbroker-model
target="${CARGO_TARGET_DIR:-target}"
exec "$target/release/lockbroker-model" "$@"
