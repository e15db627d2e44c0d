"""A local hybrid-paramd cluster for tests, examples and demos: one
coordinator and N daemon processes of the hybrid-paramd binary on loopback
(ports chosen by the kernel, read back from port files). The processes are
killed when the cluster is stopped (stop(), `with`, or interpreter exit).

    with LocalCluster("bazel-bin/server/hybrid-paramd", daemons=2,
                      daemon_flags=["--optimizer=adamw", "--lr=1e-3"]) as cl:
        c = hybrid_paramd.Client(cl.address)

Not thread-safe.
"""

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time


_OPTIMIZER_FLAGS = ("--optimizer=", "--lr=", "--beta1=", "--beta2=", "--adam_eps=",
                    "--weight_decay=", "--momentum=")


def _wait_port(path, proc, log, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("%s exited with %s before listening:\n%s" %
                               (proc.args[0], proc.returncode, _tail(log)))
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise RuntimeError("no port file %s after %.0f s:\n%s" % (path, timeout, _tail(log)))


def _tail(path, lines=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class LocalCluster:
    """Starts the cluster in the constructor (RuntimeError with the logs if
    a process fails to come up)."""

    def __init__(self, server_binary, daemons=2, expected_pushers=1, coordinator_flags=(),
                 daemon_flags=(), per_daemon_flags=(), env=None, start_timeout=30.0):
        self.dir = tempfile.mkdtemp(prefix="paramd_pycluster_")
        self.procs = []
        self.logs = []
        self._env = dict(os.environ if env is None else env)
        atexit.register(self.stop)
        # The optimizer config is the coordinator's (daemons' optimizer
        # flags are checked against it at join): optimizer flags among
        # daemon_flags are given to the coordinator too.
        mirrored = [f for f in daemon_flags if f.startswith(_OPTIMIZER_FLAGS)]
        self._server = server_binary
        self._daemon_flags = list(daemon_flags)
        # The coordinator's cluster secret (mode 0600), which a daemon that
        # replaces a lost one presents (start_daemon; docs/SECURITY.md).
        self._secret_file = os.path.join(self.dir, "cluster_secret")
        try:
            port = self._start("coordinator", [
                server_binary, "--role=coordinator", "--listen=127.0.0.1:0",
                "--daemons=%d" % daemons, "--expected_pushers=%d" % expected_pushers,
                "--cluster_secret_out=" + self._secret_file
            ] + mirrored + list(coordinator_flags), start_timeout)
            self.address = "127.0.0.1:%d" % port
            self.daemon_ports = []
            for i in range(daemons):
                extra = list(per_daemon_flags[i]) if i < len(per_daemon_flags) else []
                self.daemon_ports.append(self._start("daemon%d" % i, [
                    server_binary, "--role=daemon", "--listen=127.0.0.1:0",
                    "--coordinator=" + self.address
                ] + list(daemon_flags) + extra, start_timeout))
        except Exception:
            self.stop()
            raise

    def _start(self, name, argv, timeout):
        port_file = os.path.join(self.dir, name + ".port")
        log = os.path.join(self.dir, name + ".log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv + ["--port_file=" + port_file], stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env,
                                    start_new_session=True)
        self.procs.append(proc)
        self.logs.append(log)
        return _wait_port(port_file, proc, log, timeout)

    def start_daemon(self, flags=(), timeout=30.0):
        """Starts one more daemon (e.g. a replacement: flags=["--rank=1"])
        with the cluster's daemon flags and the coordinator's cluster secret
        (which taking a lost daemon's rank needs); returns its index."""
        i = len(self.procs) - 1
        self.daemon_ports.append(self._start("daemon%d" % i, [
            self._server, "--role=daemon", "--listen=127.0.0.1:0", "--coordinator=" + self.address,
            "--cluster_secret_file=" + self._secret_file
        ] + self._daemon_flags + list(flags), timeout))
        return i

    def daemon_pid(self, i):
        return self.procs[1 + i].pid

    def kill_daemon(self, i):
        p = self.procs[1 + i]
        p.kill()
        p.wait()

    def log_tails(self):
        return "".join("---- %s ----\n%s" % (os.path.basename(l), _tail(l)) for l in self.logs)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        if self.dir and os.path.isdir(self.dir) and not os.environ.get("PARAMD_KEEP_CLUSTER_DIR"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def load_when_ready(client, path, recipe_text=None, timeout=30.0, **load_args):
    """client.load(path, recipe_text, **load_args), retried while the
    daemons are still joining (UNAVAILABLE)."""
    from .errors import Unavailable
    deadline = time.time() + timeout
    while True:
        try:
            return client.load(path, recipe_text, **load_args)
        except Unavailable:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
