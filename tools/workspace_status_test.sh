#!/usr/bin/env bash
# tools/workspace_status.sh stamps the version and commit in a git checkout
# (12 hex digits, "-dirty" after an edit) and says "unknown" outside one
# (a source tarball), never failing the build.
set -euo pipefail
script=$(realpath tools/workspace_status.sh)
version=$(tr -d ' \n' < VERSION)
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/ws_status.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Outside git.
mkdir -p "$work/tarball/tools"
cp "$script" "$work/tarball/tools/"
cp VERSION "$work/tarball/"
out=$(cd / && "$work/tarball/tools/workspace_status.sh")
grep -qx "STABLE_PARAMD_VERSION $version" <<<"$out" || { echo "no version: $out"; exit 1; }
grep -qx "STABLE_PARAMD_GIT_COMMIT unknown" <<<"$out" || { echo "not unknown: $out"; exit 1; }

# A fresh clone (here: a new repository with one commit).
cp -r "$work/tarball" "$work/clone"
cd "$work/clone"
git init -q .
git -c user.email=t@t -c user.name=t add -A
git -c user.email=t@t -c user.name=t commit -qm init
commit=$(git rev-parse --short=12 HEAD)
out=$(tools/workspace_status.sh)
grep -qx "STABLE_PARAMD_GIT_COMMIT $commit" <<<"$out" || { echo "want $commit: $out"; exit 1; }
echo "edit" >> VERSION
out=$(tools/workspace_status.sh)
grep -qx "STABLE_PARAMD_GIT_COMMIT $commit-dirty" <<<"$out" || { echo "want dirty: $out"; exit 1; }
echo "workspace_status_test: OK"
