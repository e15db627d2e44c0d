#!/usr/bin/env bash
# Runs a Python test of python/ with Debian's python3 (torch, numpy, grpcio,
# protobuf from apt), or the interpreter $PYTHON names (tools/gpu_test.sh
# passes the GPU machine's python3, the one with CUDA torch), pointing the
# package at the runfiles' binaries.
# Usage (from a Bazel sh_test): run_py_test.sh TEST.py LIB SERVER CPP_TOOL [HPCTL]
set -euo pipefail
test_py="$1"
export HYBRID_PARAMD_LIB="$PWD/$2"
export PARAMD_SERVER="$PWD/$3"
export PARAMD_CPP_TOOL="$PWD/$4"
if [ -n "${5:-}" ]; then export PARAMD_HPCTL="$PWD/$5"; fi
export PYTHONPATH="$PWD/python:$PWD/python/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "${PYTHON:-/usr/bin/python3}" "$test_py"
