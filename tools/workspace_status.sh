#!/usr/bin/env bash
# Bazel's --workspace_status_command (.bazelrc): the version and git commit
# stamped into hybrid-paramd and hpctl (//common:build_info). Prints
# "unknown" for the commit outside a git checkout (a source tarball) or
# without git; "-dirty" when the tree differs from the commit.
cd "$(dirname "$0")/.." || exit 0
version=$(tr -d ' \n' < VERSION 2>/dev/null)
echo "STABLE_PARAMD_VERSION ${version:-0.0.0}"
commit=$(git rev-parse --short=12 HEAD 2>/dev/null) || commit=""
if [ -z "$commit" ]; then
  commit=unknown
elif ! git diff --quiet HEAD -- 2>/dev/null; then
  commit="$commit-dirty"
fi
echo "STABLE_PARAMD_GIT_COMMIT $commit"
