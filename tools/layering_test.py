#!/usr/bin/env python3
"""Tests of tools/layering_check.py on fixture trees: a tree that keeps the
rules passes; an include from a lower layer to a higher one, an include
between the peers client and server, an include up server/'s own
sub-layers, and a header brought only by a
transitive dep each fail, named by file; select() and glob() in BUILD files
are read. tools/test.sh runs the checker itself on the whole tree."""

import importlib.util
import os
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("layering_check",
                                              os.path.join(HERE, "layering_check.py"))
layering_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layering_check)

BUILDS = {
    "common/BUILD": """
        load("//bazel:paramd.bzl", "paramd_cc_library")
        paramd_cc_library(name = "log", srcs = ["log.cc"], hdrs = ["log.h"])
    """,
    "kernels/BUILD": """
        load("//bazel:paramd.bzl", "CUDA_ONLY", "paramd_cc_library")
        paramd_cc_library(name = "format", hdrs = glob(["*.h"]), deps = ["//common:log"],
                          target_compatible_with = CUDA_ONLY)
    """,
    "server/BUILD": """
        load("//bazel:paramd.bzl", "paramd_cc_library")
        paramd_cc_library(name = "daemon", srcs = ["daemon.cc"], hdrs = ["daemon.h"],
                          deps = ["//kernels:format"] + select({
                              "//bazel:cuda": ["//common:log"],
                              "//conditions:default": [],
                          }))
        sh_test(name = "script_test", srcs = ["script_test.sh"])
    """,
    "server/step/BUILD": """
        load("//bazel:paramd.bzl", "paramd_cc_library")
        paramd_cc_library(name = "optimizer", srcs = ["optimizer.cc"], hdrs = ["optimizer.h"],
                          deps = ["//server:daemon"])
    """,
    "client/BUILD": """
        load("//bazel:paramd.bzl", "paramd_cc_library")
        paramd_cc_library(name = "client", srcs = ["client.cc"], deps = ["//kernels:format"])
    """,
}
SOURCES = {
    "common/log.h": "",
    "common/log.cc": '#include "common/log.h"\n',
    "kernels/format.h": '#include "common/log.h"\n#include <vector>\n',
    "server/daemon.h": '#include "kernels/format.h"\n',
    "server/daemon.cc": '#include "server/daemon.h"\n#include "common/log.h"\n',
    "client/client.cc": '#include "kernels/format.h"\n#include "absl/status/status.h"\n',
    "server/step/optimizer.h": "",
    "server/step/optimizer.cc": '#include "server/step/optimizer.h"\n',
}


def make_tree(extra_sources=None):
    root = tempfile.mkdtemp(prefix="layering_")
    files = dict(SOURCES)
    files.update(extra_sources or {})
    for path, text in list(BUILDS.items()) + list(files.items()):
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(textwrap.dedent(text))
    return root


class LayeringCheckTest(unittest.TestCase):

    def test_a_tree_that_keeps_the_rules_passes(self):
        self.assertEqual(layering_check.check(make_tree()), [])

    def test_an_include_up_the_layers_fails(self):
        root = make_tree({"kernels/format.h": '#include "server/daemon.h"\n'})
        problems = layering_check.check(root)
        self.assertTrue(any(p.startswith("kernels/format.h: includes server/daemon.h: kernels "
                                         "(layer 1) may not include server") for p in problems),
                        problems)

    def test_peers_do_not_include_each_other(self):
        root = make_tree({"client/client.cc": '#include "server/daemon.h"\n'})
        problems = layering_check.check(root)
        self.assertTrue(any("client (layer 5) may not include server (layer 5)" in p
                            for p in problems), problems)

    def test_a_sub_package_does_not_include_a_higher_one(self):
        # server/ is layered inside: server/step sits below the process (server/).
        root = make_tree({"server/step/optimizer.cc": '#include "server/daemon.h"\n'})
        problems = layering_check.check(root)
        self.assertEqual(problems, [
            "server/step/optimizer.cc: includes server/daemon.h: server/step (sub-layer 1) may "
            "not include server (sub-layer 6)"])
        self.assertEqual(layering_check.sublayer("server/daemon/daemon.cc"), ("server/daemon", 5))
        self.assertIsNone(layering_check.sublayer("client/client.cc"))

    def test_a_header_of_a_transitive_dep_fails(self):
        # client -> kernels:format -> common:log, but common/log.h is not a direct dep.
        root = make_tree({"client/client.cc": '#include "common/log.h"\n'})
        problems = layering_check.check(root)
        self.assertEqual(problems, [
            "client/client.cc (//client:client): includes common/log.h, which no direct dep "
            "provides (//common:log)"])

    def test_main_exits_non_zero_on_problems(self):
        root = make_tree({"client/client.cc": '#include "common/log.h"\n'})
        self.assertEqual(layering_check.main(["layering_check", root]), 1)
        self.assertEqual(layering_check.main(["layering_check", make_tree()]), 0)


if __name__ == "__main__":
    unittest.main()
