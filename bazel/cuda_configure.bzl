"""Repository rule @local_cuda: the CUDA toolkit in /usr/local/cuda (or
$CUDA_HOME) as Bazel targets. Where no toolkit exists the repository still
loads, with empty targets, so that machines without CUDA can build the rest.
"""

def _cuda_configure_impl(ctx):
    home = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = ctx.path(home + "/include/cuda_runtime_api.h").exists
    if found:
        ctx.symlink(home + "/include", "include")
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)
cc_library(
    name = "cudart",
    linkopts = ["-L{home}/lib64", "-Wl,-rpath,{home}/lib64", "-lcudart", "-ldl", "-lrt", "-lpthread"],
    deps = [":cuda_headers"],
)
cc_library(
    name = "cublaslt",
    linkopts = ["-L{home}/lib64", "-lcublasLt"],
    deps = [":cudart"],
)
cc_library(
    name = "nccl",
    linkopts = ["-L{home}/lib", "-L{home}/lib64", "-Wl,-rpath,{home}/lib", "-lnccl"],
    deps = [":cudart"],
)
""".format(home = home))
    else:
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
# No CUDA toolkit at {home}: empty targets (GPU code is skipped outside --config=cuda).
cc_library(name = "cuda_headers")
cc_library(name = "cudart")
cc_library(name = "cublaslt")
cc_library(name = "nccl")
""".format(home = home))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_HOME"],
    local = True,
)
