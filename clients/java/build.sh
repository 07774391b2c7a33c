#!/usr/bin/env bash
# Builds the Java client with the JDK alone (javac and jar, no Maven, no network) and leaves
# clients/java/target/lockbroker-client.jar. The classes target Java 11 (`--release 11`), as
# the pom.xml does. The examples are compiled too (against the jar), except the Spring one,
# which needs Spring on the class path: see README.md.
#
#   clients/java/build.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

if ! command -v javac >/dev/null 2>&1 || ! command -v jar >/dev/null 2>&1; then
    echo "error: javac and jar (a JDK 11 or later) are needed; on Debian/Ubuntu:" >&2
    echo "       apt-get install -y default-jdk-headless" >&2
    exit 1
fi

rm -rf target/classes target/examples
mkdir -p target/classes target/examples
javac --release 11 -Xlint:all -Werror -encoding UTF-8 -d target/classes \
    $(find src/main/java -name '*.java' | sort)
jar --create --file target/lockbroker-client.jar -C target/classes .
javac --release 11 -Xlint:all -Werror -encoding UTF-8 -cp target/lockbroker-client.jar \
    -d target/examples $(find examples -name '*.java' -not -path '*/spring/*' | sort)
echo "built $(pwd)/target/lockbroker-client.jar"
