"""hp_py_test: a Python test of python/ run with Debian's python3 through
run_py_test.sh, against the runfiles' libhybrid_paramd.so, hybrid-paramd,
cpp_client_tool (and hpctl when `hpctl` is set)."""

def hp_py_test(name, script, hpctl = False, data = [], **kwargs):
    args = [
        "python/tests/" + script,
        "$(location //client:libhybrid_paramd.so)",
        "$(location //server:hybrid-paramd)",
        "$(location //python/tests:cpp_client_tool)",
    ]
    data = [
        "//python/tests:cpp_client_tool",
        "//python/tests:package",
        "//client:libhybrid_paramd.so",
        "//server:hybrid-paramd",
    ] + data
    if hpctl:
        args.append("$(location //hpctl)")
        data.append("//hpctl")
    native.sh_test(
        name = name,
        size = "medium",
        srcs = ["run_py_test.sh"],
        args = args,
        data = data,
        **kwargs
    )
