#!/usr/bin/env python3
"""//python:wheel_test: the wheel of //python:wheel as a user gets it.

Checks the archive (RECORD's sha256 and sizes, the tag, METADATA, the
library inside it is //client:libhybrid_paramd.so), that its version is the
one `hybrid-paramd --version` prints, then installs it offline into a fresh
virtual environment (`python3 -m venv --system-site-packages`, `pip install
--no-index`) and, from a directory outside the source tree and without
$HYBRID_PARAMD_LIB: hybrid_paramd imports from the environment, loads its own
_lib/libhybrid_paramd.so and has that __version__; $HYBRID_PARAMD_LIB, set,
wins (and a wrong one is an error, not another library); the README's Python
quick start (python/examples/quickstart.py, which README.md must hold
verbatim) runs against a hybrid-paramd serving a model that hpctl generated
and loaded, and pushes a step (version 0 -> 1).

Usage (Bazel passes these): wheel_test.py WHEEL_DIR HYBRID_PARAMD HPCTL LIB QUICKSTART README
$PYTHON: the interpreter the environment is made from (default /usr/bin/python3,
Debian's, whose torch and numpy the environment sees).
"""

import base64
import csv
import hashlib
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import zipfile

ARGS = sys.argv[1:7]
del sys.argv[1:7]
WHEEL_DIR, SERVER, HPCTL, LIB, QUICKSTART, README = [os.path.abspath(a) for a in ARGS]
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
TIMEOUT = 120

# Run inside the environment: where the package and its library come from.
WHERE = """
import json, hybrid_paramd as hp
print(json.dumps({"file": hp.__file__, "version": hp.__version__, "lib": hp.library_path()}))
"""

# Run inside the environment: $HYBRID_PARAMD_LIB wins when set.
ENV_WINS = """
import json, os, sys
from hybrid_paramd import _capi
os.environ["HYBRID_PARAMD_LIB"] = sys.argv[1] + ".missing"
try:
    _capi.lib()
    missing = None
except OSError as e:
    missing = str(e)
os.environ["HYBRID_PARAMD_LIB"] = sys.argv[1]
print(json.dumps({"missing_error": missing, "lib": _capi.lib().path}))
"""

# Run inside the environment: the quick start, then what it left behind.
RUN_QUICKSTART = """
import json, runpy, sys
g = runpy.run_path(sys.argv[1], run_name="__main__")
hp, f = g["hp"], g["f"]
print(json.dumps({"v": g["v"], "tensor": f.tensor, "format": f.format_name,
                  "shape": list(f.shape), "fetched": len(g["r"]), "file": hp.__file__,
                  "lib": hp.library_path()}))
"""


def run(argv, **kw):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TIMEOUT, **kw)
    if p.returncode != 0:
        raise AssertionError("%s exited %d:\n%s" % (" ".join(argv), p.returncode, p.stdout))
    return p.stdout


def json_line(out):
    return json.loads(out.strip().splitlines()[-1])


class WheelTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        wheels = [n for n in os.listdir(WHEEL_DIR) if n.endswith(".whl")]
        assert len(wheels) == 1, "one wheel expected in %s: %s" % (WHEEL_DIR, wheels)
        cls.wheel = os.path.join(WHEEL_DIR, wheels[0])
        m = re.fullmatch(r"hybrid_paramd-([^-]+)-py3-none-([a-z0-9_]+)\.whl", wheels[0])
        assert m, wheels[0]
        cls.version, cls.platform = m.groups()
        line = run([SERVER, "--version"]).strip()
        m = re.fullmatch(r"hybrid-paramd (\S+) \(commit \S+, -c \w+\)", line)
        assert m, line
        cls.server_version = m.group(1)

        cls.tmp = tempfile.mkdtemp(prefix="hp_wheel_test_", dir=os.environ.get("TEST_TMPDIR"))
        cls.venv = os.path.join(cls.tmp, "venv")
        # The package's users: no library path, no source tree on sys.path,
        # no pip configuration of this machine.
        cls.env = {k: v for k, v in os.environ.items()
                   if k not in ("HYBRID_PARAMD_LIB", "PYTHONPATH", "PYTHONHOME")
                   and not k.startswith("PIP_")}
        cls.env["PIP_CONFIG_FILE"] = os.devnull
        cls.cwd = os.path.join(cls.tmp, "work")  # outside the runfiles' python/
        os.mkdir(cls.cwd)
        run([PYTHON, "-m", "venv", "--system-site-packages", cls.venv], env=cls.env)
        cls.pip_log = run([os.path.join(cls.venv, "bin", "pip"), "install", "--no-index",
                           "--no-cache-dir", "--disable-pip-version-check", cls.wheel],
                          env=cls.env, cwd=cls.cwd)
        cls.site = run([cls.vpython(), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                       env=cls.env, cwd=cls.cwd).strip()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def vpython(cls):
        return os.path.join(cls.venv, "bin", "python")

    def in_venv(self, code, *args, env=None):
        return json_line(run([self.vpython(), "-c", code] + list(args),
                             env=dict(self.env, **(env or {})), cwd=self.cwd))

    def test_archive(self):
        self.assertEqual(self.platform, "linux_" + platform.machine())
        dist_info = "hybrid_paramd-%s.dist-info/" % self.version
        with zipfile.ZipFile(self.wheel) as z:
            names = set(z.namelist())
            record = list(csv.reader(io.StringIO(z.read(dist_info + "RECORD").decode())))
            recorded = {row[0] for row in record}
            self.assertEqual(recorded, names)
            for name, digest, size in record:
                if name == dist_info + "RECORD":
                    self.assertEqual((digest, size), ("", ""))
                    continue
                data = z.read(name)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                self.assertEqual(digest, "sha256=" + want.decode(), name)
                self.assertEqual(int(size), len(data), name)
            with open(LIB, "rb") as f:
                self.assertEqual(z.read("hybrid_paramd/_lib/libhybrid_paramd.so"), f.read())
            wheel = z.read(dist_info + "WHEEL").decode()
            self.assertIn("Tag: py3-none-%s\n" % self.platform, wheel)
            self.assertIn("Root-Is-Purelib: false\n", wheel)
            metadata = z.read(dist_info + "METADATA").decode()
            self.assertIn("Version: %s\n" % self.version, metadata)
            self.assertIn("Requires-Dist: torch", metadata)
            self.assertIn("Requires-Dist: numpy", metadata)
            self.assertIn("hybrid_paramd/__init__.py", names)
            self.assertIn("hybrid_paramd/client.py", names)

    def test_version_is_the_binaries(self):
        self.assertEqual(self.version, self.server_version)
        got = self.in_venv(WHERE)
        self.assertEqual(got["version"], self.server_version)

    def test_package_and_library_come_from_the_environment(self):
        self.assertIn("Successfully installed hybrid", self.pip_log)
        got = self.in_venv(WHERE)
        package = os.path.join(self.site, "hybrid_paramd")
        self.assertEqual(os.path.dirname(got["file"]), package)
        self.assertEqual(got["lib"], os.path.join(package, "_lib", "libhybrid_paramd.so"))

    def test_environment_variable_wins(self):
        other = os.path.join(self.tmp, "other", "libhybrid_paramd.so")
        os.makedirs(os.path.dirname(other), exist_ok=True)
        shutil.copyfile(LIB, other)
        got = self.in_venv(ENV_WINS, other)
        self.assertEqual(got["lib"], other)
        self.assertIn("HYBRID_PARAMD_LIB=" + other + ".missing", got["missing_error"])

    def test_readme_holds_the_quick_start(self):
        with open(QUICKSTART) as f:
            code = f.read()
        with open(README) as f:
            readme = f.read()
        self.assertTrue("```python\n" + code + "```\n" in readme,
                        "README.md does not hold python/examples/quickstart.py verbatim "
                        "as a python block")

    def test_quick_start_against_a_server(self):
        port_file = os.path.join(self.tmp, "port")
        log = open(os.path.join(self.tmp, "server.log"), "w+")
        server = subprocess.Popen([SERVER, "--listen=127.0.0.1:0", "--port_file=" + port_file],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                  start_new_session=True)
        try:
            deadline = time.time() + 30
            port = ""
            while not port:
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    self.fail("hybrid-paramd did not listen:\n" + log.read())
                time.sleep(0.05)
                if os.path.exists(port_file):
                    with open(port_file) as f:
                        port = f.read().strip()
            address = "127.0.0.1:" + port
            # The README's "Running a cluster": a synthetic model, loaded.
            model = os.path.join(self.tmp, "model.safetensors")
            run([HPCTL, "generate", "--out", model])
            run([HPCTL, "load", model, "--address", address])
            got = self.in_venv(RUN_QUICKSTART, QUICKSTART, env={"PARAMD_COORDINATOR": address})
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            log.close()
        self.assertEqual(got["v"], 1)  # the pushed step committed
        self.assertEqual(got["tensor"], "layers.0.mlp.fc1.weight")
        self.assertEqual(got["format"], "fp8_current")
        self.assertEqual(got["shape"], [257, 64])
        self.assertEqual(got["fetched"], 20)  # 10 tensors, both directions
        self.assertTrue(got["file"].startswith(self.site + os.sep), got["file"])
        self.assertTrue(got["lib"].startswith(self.site + os.sep), got["lib"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
