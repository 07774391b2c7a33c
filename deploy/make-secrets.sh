#!/usr/bin/env bash
# Makes what a secured broker needs, for trying it out: a CA, a server certificate for the
# brokers (and localhost), a client certificate, one admin bearer token and an auth file with
# its digest. Everything goes into the directory given (default deploy/secrets/, which git
# ignores). In production, take the certificates from your own CA.
#
#   deploy/make-secrets.sh [DIR]
set -euo pipefail

dir=${1:-"$(dirname "${BASH_SOURCE[0]}")/secrets"}
mkdir -p "$dir"
cd "$dir"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
    -subj "/CN=lockbroker CA" -keyout ca.key -out ca.crt 2>/dev/null

# The server certificate: every name a client may reach a broker by.
sans="DNS:localhost,IP:127.0.0.1,DNS:lockbroker,DNS:broker1,DNS:broker2,DNS:broker3"
sans="$sans,DNS:lockbroker.default.svc,DNS:lockbroker.default.svc.cluster.local"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=lockbroker" \
    -keyout tls.key -out tls.csr 2>/dev/null
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$sans") \
    -out tls.crt 2>/dev/null

# A client certificate, for brokers run with tls_client_ca = ca.crt.
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=orders-app" \
    -keyout client.key -out client.csr 2>/dev/null
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 \
    -extfile <(printf 'extendedKeyUsage=clientAuth\n') -out client.crt 2>/dev/null
rm -f tls.csr client.csr ca.srl

token=$(openssl rand -hex 32)
printf '%s\n' "$token" > admin.token
cat > auth.toml <<TOML
[[tokens]]
name = "admin"
token_sha256 = "$(printf '%s' "$token" | sha256sum | cut -d' ' -f1)"
prefixes = [""]
permissions = ["admin"]
TOML
# The brokers run as uid 10001 and must read these through the bind mounts of compose.secure.yaml
# (Kubernetes secrets set their own modes). The CA key and the client key stay private.
chmod 644 ca.crt tls.crt tls.key auth.toml client.crt
echo "made in $dir: ca.crt, tls.crt/tls.key, client.crt/client.key, auth.toml, admin.token"
