#!/usr/bin/env bash
# Installs every Debian 12 package hybrid-paramd needs to build and test
# (--build-only: to build). Idempotent and quiet when everything is already
# there. Needs root (or sudo).
set -euo pipefail

# What the build needs (also what deploy/docker/Dockerfile installs:
# `tools/install_deps.sh --build-only`).
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
  libcli11-dev
  clang
  libfuzzer-14-dev
  libclang-rt-14-dev
  python3
)
# What the tests need besides: the format check's clang-format (and
# clang-tidy for tools/tidy_check.sh), the Python
# client's (python3-venv: the wheel's install test), and the deploy kit's
# checks (python3-yaml for the Kubernetes manifests, systemd-analyze,
# a single-node Slurm, promtool for the Prometheus alert rules).
TEST_PACKAGES=(
  clang-format
  clang-tidy
  python3-numpy
  python3-torch
  python3-venv
  python3-grpcio
  python3-protobuf
  python3-yaml
  systemd
  slurm-wlm
  prometheus
)
if [ "${1:-}" != "--build-only" ]; then
  PACKAGES+=("${TEST_PACKAGES[@]}")
fi

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
