#!/bin/sh
# Generates the TLS test certificates of testing/fixtures/tls/ with the openssl CLI (docs/tls.md):
#   ca.crt                      the cluster CA the tests trust (--tls-ca)
#   node.crt/node.key           a node certificate, SANs localhost, 127.0.0.1 and ::1, for servers
#                               and clients (every kvfence process of a test cluster presents it)
#   client.crt/client.key       a client-only certificate (a router that only connects)
#   other-ca.crt                a CA nobody trusts, and other-node.crt/other-node.key signed by it
#                               (same SANs): a peer from another cluster, for the negative tests
# EC P-256 keys, valid 100 years. The CA keys are deleted once they signed: these are test
# fixtures, committed on purpose; an operator makes their own the same way (docs/tls.md).
# Usage: scripts/make-test-certs.sh [DIR]   (default testing/fixtures/tls)
set -eu
DIR=${1:-testing/fixtures/tls}
DAYS=36500
mkdir -p "$DIR"
cd "$DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

ca() { # name, subject
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days "$DAYS" \
    -subj "/CN=$2" -keyout "$TMP/$1.key" -out "$1.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

leaf() { # name, ca, common name, extendedKeyUsage
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
    -subj "/CN=$3" -keyout "$1.key" -out "$TMP/$1.csr" 2>/dev/null
  cat >"$TMP/$1.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=$4
subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
EXT
  openssl x509 -req -in "$TMP/$1.csr" -CA "$2.crt" -CAkey "$TMP/$2.key" -CAcreateserial \
    -CAserial "$TMP/$2.srl" -days "$DAYS" -sha256 -extfile "$TMP/$1.ext" -out "$1.crt" 2>/dev/null
  chmod 600 "$1.key"
}

ca ca "kvfence test cluster CA"
leaf node ca "kvfence test node" serverAuth,clientAuth
leaf client ca "kvfence test router" clientAuth
ca other-ca "kvfence untrusted CA"
leaf other-node other-ca "kvfence node of another cluster" serverAuth,clientAuth
openssl verify -CAfile ca.crt node.crt client.crt >/dev/null
echo "TLS test certificates written to $DIR"
