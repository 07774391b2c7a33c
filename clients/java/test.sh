#!/usr/bin/env bash
# Builds the Java client (build.sh) and runs its tests against real broker processes: one on the
# embedded store and one on a redis-server the tests start on a free loopback port. No JUnit
# (nothing to download): a small runner whose last line is "N passed, M failed"; the exit status
# is non-zero when a test failed. Arguments filter tests by name (e.g. `test.sh redis::`).
#
#   LOCKBROKER_BIN   the broker binary (default: the repository's target/debug/lockbroker,
#                    which `cargo build --bin lockbroker` or `cargo test` builds)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

./build.sh
export LOCKBROKER_BIN="${LOCKBROKER_BIN:-$(cd ../.. && pwd)/target/debug/lockbroker}"
if [[ ! -x "$LOCKBROKER_BIN" ]]; then
    echo "error: no broker binary at $LOCKBROKER_BIN: run \`cargo build --bin lockbroker\` first, or set LOCKBROKER_BIN." >&2
    exit 1
fi
if ! command -v redis-server >/dev/null 2>&1; then
    echo "error: redis-server is not on PATH (scripts/test.sh installs it)." >&2
    exit 1
fi

rm -rf target/test-classes
mkdir -p target/test-classes
classpath=target/lockbroker-client.jar:target/examples
javac --release 11 -Xlint:all -Werror -encoding UTF-8 -cp "$classpath" -d target/test-classes \
    $(find src/test/java -name '*.java' | sort)
exec java -cp "$classpath:target/test-classes" io.lockbroker.client.tests.ClientTests "$@"
