# Sourced (not run) by the scripts that carry GPU binaries to the GPU
# machine, which has no Bazel (docs/ARCHITECTURE.md, "Build"):
# tools/gpu_bundle.sh, tests/gpu_nccl_run.sh, tests/gpu_backend_run.sh,
# tests/gpu_fetch_run.sh.
#
# A bundle folder holds the binaries and the shared libraries they load that
# the GPU machine may lack: everything `ldd` resolves except glibc,
# libstdc++/libgcc, the CUDA driver, cuBLAS and NCCL (the machine has those;
# KINDS.md). libcudart goes to fallback/, put on LD_LIBRARY_PATH only where
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
  cp -L "$src" "$dest"
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

# bundle_targets BUNDLE LAYOUT TARGET...
#   bundle_binary for each Bazel target from bazel-bin (built before with
#   --config=cuda). LAYOUT "pkg": BUNDLE/<package>/<name> (binaries that
#   find each other by workspace-relative paths); "bin": BUNDLE/bin/<name>.
bundle_targets() {
  local bundle=$1 layout=$2 t name pkg dest
  shift 2
  for t in "$@"; do
    name=${t##*:}
    pkg=${t%%:*}
    pkg=${pkg#//}
    if [ "$layout" = bin ]; then dest="$bundle/bin/$name"; else dest="$bundle/$pkg/$name"; fi
    bundle_binary "bazel-bin/$pkg/$name" "$dest" "$bundle" || return 1
  done
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

# bundle_build_pack BUNDLE TARGET... [-- FILE...]
#   The whole `bundle` step of a run script whose binaries find each other
#   by workspace paths: --config=cuda build, "pkg" layout, packed archive.
#   FILEs (the run script, this library) go into the archive's top level.
bundle_build_pack() {
  local bundle=$1
  shift
  local targets=() files=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do targets+=("$1"); shift; done
  if [ "${1:-}" = -- ]; then shift; files=("$@"); fi
  bazel build --config=cuda "${targets[@]}" || return 1
  rm -rf "$bundle"
  bundle_targets "$bundle" pkg "${targets[@]}" || return 1
  if [ ${#files[@]} -gt 0 ]; then cp "${files[@]}" "$bundle/" || return 1; fi
  bundle_pack "$bundle"
  du -sh "$bundle"
}

# bundle_run_env DIR
#   On the GPU machine: the environment the binaries of the unpacked bundle
#   DIR need. NVLink multicast off (KINDS.md), the bundle's libraries first,
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
