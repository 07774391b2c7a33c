#!/usr/bin/env bash
# Checks that the `rust-version` the workspace declares (Cargo.toml) is truthful, without
# installing that toolchain: CI builds with the current stable only.
#
#   scripts/check-msrv.sh
#
# - every workspace member declares the same rust-version;
# - every package in Cargo.lock that declares a rust-version needs at most ours (a dependency
#   that needs a newer compiler would make ours a lie);
# - the language the code uses fits: edition 2024 needs 1.85, let chains (`&& let`) need 1.88.
# The standard-library APIs the code calls are checked by clippy's `incompatible_msrv` lint,
# which reads rust-version; .ci/run denies it in its clippy step.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo metadata --format-version 1 --locked | python3 -c '
import json, re, subprocess, sys

def parse(version):
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

meta = json.load(sys.stdin)
members = set(meta["workspace_members"])
ours = {p["name"]: p for p in meta["packages"] if p["id"] in members}
declared = {name: p.get("rust_version") for name, p in ours.items()}
missing = sorted(name for name, v in declared.items() if not v)
if missing:
    sys.exit("error: no rust-version in " + ", ".join(missing))
if len(set(map(parse, declared.values()))) != 1:
    sys.exit(f"error: the workspace members declare different rust-versions: {declared}")
msrv_text = next(iter(declared.values()))
msrv = parse(msrv_text)

failures = []
checked = 0
for p in meta["packages"]:
    need = p.get("rust_version")
    if p["id"] in members or not need:
        continue
    checked += 1
    if parse(need) > msrv:
        name, version = p["name"], p["version"]
        failures.append(f"{name} {version} needs Rust {need}")

# The language the code itself uses.
editions = {name: p["edition"] for name, p in ours.items()}
if any(e == "2024" for e in editions.values()) and msrv < (1, 85, 0):
    failures.append(f"edition 2024 ({editions}) needs Rust 1.85")
chains = subprocess.run(
    ["grep", "-rlE", r"(&&|\|\|)[[:space:]]*let[[:space:]]", "src", "tests", "test-support/src"],
    capture_output=True, text=True,
).stdout.split()
if chains and msrv < (1, 88, 0):
    failures.append(f"let chains (in {chains[0]}, …) need Rust 1.88")

if failures:
    print(f"error: the declared rust-version {msrv_text} is too old:", file=sys.stderr)
    for f in failures:
        print(f"  {f}", file=sys.stderr)
    sys.exit(1)
print(f"rust-version {msrv_text}: {checked} dependencies declare one, none needs more; "
      f"edition {sorted(set(editions.values()))} and the code fit it")
'
