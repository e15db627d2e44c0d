# Sourced (not run) by the scripts that carry GPU binaries to the GPU
# machine, where there may be no Bazel and no nvcc: tools/gpu_test.sh (the
# tests) and tools/gpu_bench.sh (the benchmarks).
#
# A bundle folder holds the binaries and the shared libraries they load that
# the GPU machine may lack: everything `ldd` resolves except glibc,
# libstdc++/libgcc, the CUDA driver, cuBLAS and NCCL (a GPU machine has
# those). libcudart goes to fallback/, put on LD_LIBRARY_PATH only where
# the machine has no CUDA 13 runtime.

# bundle_binary SRC DEST BUNDLE
#   Copies the built binary SRC (e.g. bazel-bin/server/hybrid-paramd) to DEST
#   and the libraries it loads into BUNDLE/lib (BUNDLE/fallback for
#   libcudart). DEST's folder is created.
bundle_binary() {
  local src=$1 dest=$2 bundle=$3 lib base
  # bazel-bin is shared by every build in this tree: a CPU build between the
  # --config=cuda build and this copy leaves a hybrid-paramd without the GPU
  # backend and the nccl transport (its daemons would exit at start there).
  # (ldd's output captured first: `ldd | grep -q` under pipefail fails when
  # grep exits early and ldd gets SIGPIPE.)
  if [ "$(basename "$src")" = hybrid-paramd ] && [[ "$(ldd "$src")" != *libnccl* ]]; then
    echo "bundle: $src is not a --config=cuda build (bazel-bin was rebuilt); bundle again" >&2
    return 1
  fi
  mkdir -p "$(dirname "$dest")" "$bundle/lib" "$bundle/fallback"
  cp -L "$src" "$dest" || return 1
  chmod u+w "$dest"
  ldd "$src" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
    base=$(basename "$lib")
    case "$base" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;
      libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libcublas*|libnccl*|libnvidia*) ;;
      libcudart.so*) cp -Ln "$lib" "$bundle/fallback/" ;;
      *) cp -Ln "$lib" "$bundle/lib/" ;;
    esac
  done
  chmod -R u+w "$bundle"
}

# bundle_targets BUNDLE TARGET...
#   bundle_binary for each Bazel target from $BAZEL_BIN (default bazel-bin;
#   built before with --config=cuda) to BUNDLE/<package>/<name>: the
#   binaries find each other by workspace-relative paths.
bundle_targets() {
  local bundle=$1 t path
  shift
  for t in "$@"; do
    path=$(bundle_label_path "$t")
    bundle_binary "${BAZEL_BIN:-bazel-bin}/$path" "$bundle/$path" "$bundle" || return 1
  done
}

# bundle_label_path //pkg/sub:name  ->  pkg/sub/name (its workspace path, as
#   in bazel-bin and in a "pkg" layout bundle).
bundle_label_path() {
  local pkg=${1%%:*}
  pkg=${pkg#//}
  echo "$pkg/${1##*:}"
}

# bundle_universe
#   Every package of the workspace as a query expression, spelled out:
#   //... would also descend into the convenience symlinks of another output
#   base (bazel-<name>).
bundle_universe() {
  local d first=1
  for d in */; do
    d=${d%/}
    case "$d" in bazel-*) continue ;; esac
    [ -n "$(find "$d" -name BUILD -print -quit)" ] || continue
    if [ $first = 1 ]; then first=0; else printf ' + '; fi
    printf '//%s/...' "$d"
  done
}

# bundle_tagged TAG [tests]
#   The targets with exactly the tag TAG ('\bgpu\b' would also match
#   "no-gpu" and "gpu_bench"), sorted; "tests": test rules only. Runs
#   ${BAZEL:-bazel} query.
bundle_tagged() {
  local set
  set=$(bundle_universe)
  if [ "${2:-}" = tests ]; then set="tests($set)"; fi
  ${BAZEL:-bazel} query "attr(tags, \"[\\[ ,]$1[,\\]]\", $set)" 2>/dev/null | sort
}

# bundle_data_binaries TARGET...
#   What the targets start: the workspace's cc_binary rules among their
#   dependencies and data (libhybrid_paramd.so included), tests and
#   //third_party left out; sorted.
bundle_data_binaries() {
  ${BAZEL:-bazel} query "kind('cc_binary', deps(set($*)) intersect ($(bundle_universe)))" 2>/dev/null |
    grep -v -e '_test$' -e '//third_party' | sort
}

# bundle_pack BUNDLE
#   Strips debug sections and replaces BUNDLE's contents by one
#   BUNDLE/bundle.tar.xz: the working tree plus what a call carries must stay
#   under 64 MiB. bundle_unpack BUNDLE DIR reverses it on the GPU machine.
bundle_pack() {
  local bundle=$1 tmp
  tmp=$(mktemp /tmp/gpu_bundle.XXXXXX.tar.xz)
  find "$bundle" -type f \( -name '*.so*' -o -perm -u+x \) -exec strip --strip-debug {} + 2>/dev/null || true
  tar -C "$bundle" -cJf "$tmp" .
  rm -rf "$bundle"
  mkdir -p "$bundle"
  mv "$tmp" "$bundle/bundle.tar.xz"
  chmod 644 "$bundle/bundle.tar.xz"
}
bundle_unpack() {
  mkdir -p "$2" && tar -C "$2" -xJf "$1/bundle.tar.xz"
}

# bundle_extract BUNDLE DIR
#   On the GPU machine: prints the folder to run from. A packed BUNDLE is
#   unpacked into DIR once per archive (several runs in one call reuse it);
#   an already unpacked BUNDLE is used as it is.
bundle_extract() {
  local bundle=$1 dir=$2 stamp
  if [ ! -f "$bundle/bundle.tar.xz" ]; then echo "$bundle"; return 0; fi
  stamp=$(stat -c %s-%Y "$bundle/bundle.tar.xz")
  if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$dir"
    bundle_unpack "$bundle" "$dir" >&2 || return 1
    echo "$stamp" > "$dir/.stamp"
  fi
  echo "$dir"
}

# bundle_run_env DIR
#   On the GPU machine: the environment the binaries of the unpacked bundle
#   DIR need. NVLink multicast off (NCCL_NVLS_ENABLE=0 and its torch and
#   NVSHMEM equivalents), the bundle's libraries first,
#   its libcudart only where the machine has no CUDA 13 runtime, and NCCL
#   (too large to carry) from the image's Python packages where the system
#   has none. (ldconfig's output is captured first: `ldconfig -p | grep -q`
#   under pipefail fails when grep exits early.)
bundle_run_env() {
  local dir=$1 cache d
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cache=$(ldconfig -p 2>/dev/null || true)
  if [[ "$cache" != *libcudart.so.13* ]] && ! ls /usr/local/cuda/lib64/libcudart.so.13* >/dev/null 2>&1; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir/fallback"
  fi
  if [[ "$cache" != *libnccl.so.2* ]] && ! ls /usr/local/cuda/lib*/libnccl.so.2 >/dev/null 2>&1; then
    d=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__ or nvidia.nccl.__path__[0]))' 2>/dev/null)
    [ -z "$d" ] && d=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '*/proc/*' 2>/dev/null | head -1)")
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d/lib:$d"
    echo "(libnccl from $d)"
  fi
}
