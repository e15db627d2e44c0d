#!/bin/bash
# Makes a private CA and certificates for a hybrid-paramd cluster with
# openssl (docs/SECURITY.md explains each step). Also what the TLS tests run.
#
#   tools/make_certs.sh DIR [SERVER_NAMES]
#
# DIR gets:
#   ca.pem / ca.key            the CA (keep ca.key offline in production)
#   server.pem / server.key    coordinator and daemons: serverAuth + clientAuth
#                              (daemons present it as client certificate too)
#   client.pem / client.key    trainers and hpctl under mutual TLS
#   other-ca.pem, other-client.pem / .key   an unrelated CA and a client it
#                              signed (tests: must be refused)
# SERVER_NAMES: subjectAltName entries of server.pem, default
# "IP:127.0.0.1,DNS:localhost"; name every address the processes are reached
# at, e.g. "DNS:node0.example.com,DNS:node1.example.com,IP:10.0.0.5".
set -euo pipefail
dir=${1:?usage: make_certs.sh DIR [SERVER_NAMES]}
names=${2:-IP:127.0.0.1,DNS:localhost}
days=${CERT_DAYS:-365}
mkdir -p "$dir"
cd "$dir"
umask 077
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
ca() {  # NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days "$days" -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}
leaf() {  # NAME CN CA EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$2"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial \
    -out "$1.pem" -days "$days" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca "hybrid-paramd CA"
leaf server "hybrid-paramd server" ca \
  "subjectAltName=$names
extendedKeyUsage=serverAuth,clientAuth
keyUsage=critical,digitalSignature"
leaf client "hybrid-paramd client" ca \
  "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
ca other-ca "unrelated CA"
leaf other-client "stranger" other-ca \
  "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
rm -f ./*.srl
chmod 644 ./*.pem
echo "certificates in $dir: ca.pem server.pem/.key client.pem/.key (server names: $names)"
