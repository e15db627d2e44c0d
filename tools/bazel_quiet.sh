#!/usr/bin/env bash
# Sourced by tools/demo.sh and tools/test.sh: bazel_quiet runs bazel without
# its progress lines and drops linux-sandbox debug lines, so the output is the
# build's warnings and errors, the test results and the program's own output.
#
# Why the filter: Debian's bazel-bootstrap sets --sandbox_debug in
# /etc/bazel/bazelrc. The repo's .bazelrc turns it off, but actions built
# while it was on keep their ~40 debug lines per action as recorded stderr,
# and Bazel replays that stderr on every disk- or remote-cache hit. The
# filter drops those lines and the "INFO: From <action>:" headers left empty.
#
# Usage: bazel_quiet <bazel command> [args...]; returns bazel's exit status.

bazel_quiet_filter() {
  awk '
    /^[0-9]+\.[0-9]+: src\/main\/tools\/[a-z0-9_-]+\.cc:[0-9]+: / { next }
    /^INFO: From / { held = $0; next }
    {
      if (held != "") {
        # A header followed directly by another Bazel line had only debug output.
        if ($0 !~ /^(INFO: |WARNING: |ERROR: |Target |  bazel-|\[[0-9,]+ \/ |\/\/)/) print held
        held = ""
      }
      print; fflush()
    }
  '
}

bazel_quiet() {
  local cmd=$1
  shift
  bazel "$cmd" --noshow_progress "$@" 2>&1 | bazel_quiet_filter
  return "${PIPESTATUS[0]}"
}
