#!/usr/bin/env bash
# Installs every Debian 12 package hybrid-paramd needs to build and test.
# Idempotent and quiet when everything is already there. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  bazel-bootstrap
  build-essential
  protobuf-compiler
  protobuf-compiler-grpc
  libprotobuf-dev
  libgrpc++-dev
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libxxhash-dev
  nlohmann-json3-dev
  prometheus-cpp-dev
  libcivetweb-dev
  libspdlog-dev
  libre2-dev
  clang
  libfuzzer-14-dev
  libclang-rt-14-dev
  python3
  python3-numpy
  python3-torch
  python3-grpcio
  python3-protobuf
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install_deps: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done" >&2
