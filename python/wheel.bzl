"""hp_wheel: the hybrid_paramd wheel (python/build_wheel.py) in a directory
named after the target, e.g. bazel-bin/python/wheel/
hybrid_paramd-0.1.0-py3-none-linux_x86_64.whl. A directory because the
file's name holds the version and platform, known only when it runs (the
version from Bazel's stable-status.txt, as //common:build_info's)."""

def _hp_wheel_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args = ctx.actions.args()
    args.add(ctx.file._builder)
    args.add("--out_dir", out.path)
    args.add("--status", ctx.info_file)
    args.add("--lib", ctx.file.lib)
    args.add_all(ctx.files.srcs)
    ctx.actions.run_shell(
        command = 'python3 "$@" >/dev/null',
        arguments = [args],
        inputs = ctx.files.srcs + [ctx.file.lib, ctx.file._builder, ctx.info_file],
        outputs = [out],
        mnemonic = "HpWheel",
        progress_message = "Writing the hybrid_paramd wheel",
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

hp_wheel = rule(
    implementation = _hp_wheel_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".py"], doc = "the package's .py files"),
        "lib": attr.label(allow_single_file = True, doc = "libhybrid_paramd.so"),
        "_builder": attr.label(default = ":build_wheel.py", allow_single_file = True),
    },
)
