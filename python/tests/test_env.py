"""Paths of the binaries the Python tests use: from the environment
(python/tests/run_py_test.sh sets them from Bazel's runfiles) or the
source tree's bazel-bin."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))


def path(var, default):
    p = os.environ.get(var) or os.path.join(ROOT, default)
    if not os.path.exists(p):
        raise RuntimeError("%s not found (set %s or bazel build it)" % (p, var))
    return p


SERVER = path("PARAMD_SERVER", "bazel-bin/server/hybrid-paramd")
CPP_TOOL = path("PARAMD_CPP_TOOL", "bazel-bin/python/tests/cpp_client_tool")


def tmpdir(prefix):
    import tempfile
    return tempfile.mkdtemp(prefix=prefix)
