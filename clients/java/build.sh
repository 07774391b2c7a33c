#!/usr/bin/env bash
# Builds the Java client with the JDK alone (javac, jar and javadoc; no Maven, no network) and
# leaves in clients/java/target/:
#   lockbroker-client.jar           the classes; its manifest carries the version from pom.xml
#                                   (Implementation-/Specification-Version) and
#                                   Automatic-Module-Name: io.lockbroker.client
#   lockbroker-client-sources.jar   the sources
#   lockbroker-client-javadoc.jar   the API documentation; any javadoc warning (-Xdoclint:all)
#                                   fails the build
# The classes target Java 11 (`--release 11`), as the pom.xml does. The examples are compiled
# too (against the jar), except the Spring one, which needs Spring on the class path: see README.md.
#
#   clients/java/build.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

if ! command -v javac >/dev/null 2>&1 || ! command -v jar >/dev/null 2>&1 || ! command -v javadoc >/dev/null 2>&1; then
    echo "error: javac, jar and javadoc (a JDK 11 or later) are needed; on Debian/Ubuntu:" >&2
    echo "       apt-get install -y default-jdk-headless" >&2
    exit 1
fi

# The project's own version: the <version> right after <artifactId>lockbroker-client</artifactId>.
version=$(tr -d '\n' <pom.xml | sed -n 's:.*<artifactId>lockbroker-client</artifactId>[[:space:]]*<version>\([^<]*\)</version>.*:\1:p')
if [[ -z "$version" ]]; then
    echo "error: no <version> after <artifactId>lockbroker-client</artifactId> in pom.xml" >&2
    exit 1
fi

rm -rf target/classes target/examples target/javadoc
mkdir -p target/classes target/examples
sources=$(find src/main/java -name '*.java' | sort)
javac --release 11 -Xlint:all -Werror -encoding UTF-8 -d target/classes $sources
cat >target/MANIFEST.MF <<MANIFEST
Automatic-Module-Name: io.lockbroker.client
Implementation-Title: lockbroker-client
Implementation-Version: $version
Implementation-Vendor: lockbroker
Specification-Title: lockbroker-client
Specification-Version: $version
Specification-Vendor: lockbroker
MANIFEST
jar --create --file target/lockbroker-client.jar --manifest target/MANIFEST.MF -C target/classes .
jar --create --file target/lockbroker-client-sources.jar -C src/main/java .
javadoc --release 11 -Xdoclint:all -Xmaxwarns 10000 -Werror -quiet -encoding UTF-8 -d target/javadoc \
    -doctitle "lockbroker client $version" -windowtitle "lockbroker client $version" $sources
jar --create --file target/lockbroker-client-javadoc.jar -C target/javadoc .
javac --release 11 -Xlint:all -Werror -encoding UTF-8 -cp target/lockbroker-client.jar \
    -d target/examples $(find examples -name '*.java' -not -path '*/spring/*' | sort)
echo "built $(pwd)/target/lockbroker-client.jar $version (and -sources.jar, -javadoc.jar)"
