#!/usr/bin/env python3
"""Tests of tools/doc_test.py (the documentation test) on fixture markdown in
a fixture repository, with stand-ins for hybrid-paramd, hpctl and
hybrid-paramd-health: a good document passes (commands run in the scratch
directory, the test command is not run, background processes are ended,
durations are free in expected output), and a bad one fails naming each
problem's file and line (a block without a marker, a failing command, a
wrong test command, output that differs, a missing path, unknown flags and
hpctl commands, bad markers)."""

import importlib.util
import io
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("doc_test", os.path.join(HERE, "doc_test.py"))
doc_test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doc_test)

FAKE_HYBRID_PARAMD = """#!/bin/sh
cat <<'EOF'
hybrid-paramd: a stand-in.
  Flags from server/main.cc:
    --role (coordinator, daemon or both); default: "both";
    --listen (HOST:PORT); default: "127.0.0.1:7070";
    --daemons (number of daemons); default: 1;
    --insecure_listen_anywhere (plaintext beyond loopback); default: false;
    --tls_ca (PEM CA); default: "";
EOF
"""
FAKE_HEALTH = """#!/bin/sh
cat <<'EOF'
  Flags from deploy/health_probe.cc:
    --address (HOST:PORT); default: "127.0.0.1:7070";
    --service (the service); default: "";
    --tls_ca (PEM CA); default: "";
    --wait (seconds); default: 0;
    --quiet (print nothing); default: false;
EOF
"""
FAKE_HPCTL = """#!/bin/sh
case "$1 $2" in
  "--help "*) printf 'Usage: hpctl <command>\\n\\nCommands:\\n  load  load a model\\n  status  show\\n  generate  write a model\\n\\n'"'"'hpctl --version'"'"' prints the version.\\n' ;;
  "load --help") printf 'Options:\\n  --address  HOST:PORT\\n  --force  replace\\n' ;;
  "status --help") printf 'Options:\\n  --address  HOST:PORT\\n' ;;
  "generate --help") printf 'Options:\\n  --out  file\\n  --preset  name\\n' ;;
  "status ") echo "cluster: fake" ;;
  *) echo "hpctl: unknown command '$1'" >&2; exit 2 ;;
esac
"""

GOOD = """\
# A good document

<!-- doc-test: run -->
```sh
echo hello > out.txt          # lands in the scratch directory
cat out.txt
(umask 077
 for r in a b; do echo "$r"; done > list.txt)
test "$(cat list.txt | tr -d '\\n')" = ab
echo one \\
  two
if true; then
  echo in-if
fi
bash tools/test.sh            # the test command: not run
sleep 300 & echo $! > "$FIXTURE_PIDFILE"
echo "loss 1.50, batch 256, in 3.2 ms and 1.5 s" > /tmp/$FIXTURE_PROBE
cat /tmp/$FIXTURE_PROBE
test ! -e "$REAL_TMP/$FIXTURE_PROBE"
test "$HOME" != "$REAL_HOME"
hpctl status
```

<!-- doc-test: output: cat /tmp/$FIXTURE_PROBE -->
```
loss 1.50, batch 256, in 9.9 ms and 20.0 s
```

<!-- doc-test: skip: needs a cluster -->
```sh
hybrid-paramd --role=daemon --listen=0.0.0.0:1 --noinsecure_listen_anywhere \\
  --daemons=2
docker run --rm -p 127.0.0.1:1:1 -v "$PWD/x:/x" hybrid-paramd --role=both --tls_ca=/x/ca.pem
hpctl load /models/x --address H:1 [--force]
hpctl --version
hybrid-paramd-health --address=H:1 --wait=30
kubectl apply -f deploy/x.yaml
cp deploy/[xy].yaml deploy/*.yaml /etc/
bash tools/test.sh --anything   # skipped blocks are not the test command's business
```

<!-- doc-test: text: a recipe -->
```
rule { pattern: ".*" }
```

```python
print("python blocks take no marker")
```

<!-- doc-test: run -->
```console
$ echo "value 42 in 7 ms"
value 42 in 1 ms
```
"""

BAD = """\
# A bad document

```sh
echo no marker
```

```
no language, no marker
```

<!-- doc-test: run -->
```sh
true
ls does-not-exist
touch "$FIXTURE_AFTER"
```

<!-- doc-test: run -->
```bash
false && true
```

<!-- doc-test: run -->
```sh
bash tools/test.sh --quick
echo "loss 1.50"
```

<!-- doc-test: output: echo "loss 1.50" -->
```
loss 1.60
```

<!-- doc-test: skip: needs a cluster -->
```sh
kubectl apply -f deploy/missing.yaml deploy/[ab].yaml
hybrid-paramd --role=daemon --no_such_flag
hpctl frobnicate
hpctl load /m --no_such_option
hybrid-paramd-health --bogus=1
```

<!-- doc-test: maybe -->
```sh
echo unknown decision
```

<!-- doc-test: skip -->
```sh
echo no reason
```

<!-- doc-test: run -->
A paragraph, not a fence.

<!-- doc-test: run -->
```python
print("a marker on python")
```

<!-- doc-test: output: echo never ran -->
```
x
```

<!-- doc-test: run -->
```console
$ echo "value 41"
value 42
```
"""


def write(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


class Fixture:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="doc-test-test-")
        self.root = os.path.join(self.dir, "repo")
        self.bin = os.path.join(self.dir, "bin")
        self.mark = os.path.join(self.dir, "test_sh_ran")
        write(os.path.join(self.root, ".ci/run"),
              "#!/usr/bin/env bash\nset -euo pipefail\nexec bash tools/test.sh\n", 0o755)
        write(os.path.join(self.root, "tools/test.sh"),
              f"#!/bin/sh\ntouch {self.mark}\nexit 1\n", 0o755)
        write(os.path.join(self.root, "deploy/x.yaml"), "kind: x\n")
        write(os.path.join(self.root, "GOOD.md"), GOOD)
        write(os.path.join(self.root, "BAD.md"), BAD)
        write(os.path.join(self.bin, "hybrid-paramd"), FAKE_HYBRID_PARAMD, 0o755)
        write(os.path.join(self.bin, "hpctl"), FAKE_HPCTL, 0o755)
        write(os.path.join(self.bin, "hybrid-paramd-health"), FAKE_HEALTH, 0o755)

    def run(self, doc, env=None, args=("--timeout", "60")):
        """(exit status, output) of doc_test.py on doc, in a subprocess."""
        r = subprocess.run([sys.executable, os.path.join(HERE, "doc_test.py"), "--root", self.root,
                            "--bin_dir", self.bin, *args, doc], capture_output=True, text=True,
                           env=dict(os.environ, **(env or {})), timeout=120)
        return r.returncode, r.stdout + r.stderr


class DocTestTest(unittest.TestCase):
    def setUp(self):
        self.fx = Fixture()

    def tearDown(self):
        shutil.rmtree(self.fx.dir, ignore_errors=True)

    def assertGone(self, pid):
        """pid ends (or is a zombie no one reaped yet) within 5 s."""
        for _ in range(50):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return
            except FileNotFoundError:
                return
            time.sleep(0.1)
        self.fail(f"the background process {pid} is still running")

    def test_good_document_passes(self):
        pidfile = os.path.join(self.fx.dir, "sleeper.pid")
        probe = f"doc-test-probe-{os.getpid()}"
        real_tmp = tempfile.gettempdir()
        rc, out = self.fx.run("GOOD.md", {"FIXTURE_PIDFILE": pidfile, "FIXTURE_PROBE": probe,
                                          "REAL_TMP": real_tmp,
                                          "REAL_HOME": os.environ.get("HOME", "/")})
        self.assertEqual(rc, 0, out)
        self.assertIn("2 run, 1 skip, 1 output, 1 text blocks", out)
        self.assertIn("GOOD.md:15: `bash tools/test.sh` is the test command", out)
        # Written in the scratch directory, not the repository or /tmp.
        self.assertFalse(os.path.exists(os.path.join(self.fx.root, "out.txt")))
        self.assertFalse(os.path.exists(os.path.join(real_tmp, probe)))
        # The test command did not run; the background sleep was ended.
        self.assertFalse(os.path.exists(self.fx.mark))
        with open(pidfile) as f:
            self.assertGone(int(f.read()))

    def test_bad_document_names_every_problem(self):
        after = os.path.join(self.fx.dir, "after")
        rc, out = self.fx.run("BAD.md", {"FIXTURE_AFTER": after})
        self.assertEqual(rc, 1, out)
        expected = [
            r"BAD\.md:3: a sh block without a doc-test marker",
            r"BAD\.md:7: a block without a language without a doc-test marker",
            r"BAD\.md:14: `ls does-not-exist` exited 2; its output ends:\n.*does-not-exist",
            r"BAD\.md:20: `false && true` exited 1",
            r"BAD\.md:25: the test command 'bash tools/test\.sh --quick' is not what \.ci/run "
            r"runs \('bash tools/test\.sh'\)",
            r"BAD\.md:31: `echo \"loss 1\.50\"` did not print 'loss 1\.60'; the output has: "
            r"'loss 1\.50'",
            r"BAD\.md:36: deploy/missing\.yaml: no such file in the repository",
            r"BAD\.md:36: deploy/\[ab\]\.yaml: no such file in the repository",
            r"BAD\.md:37: hybrid-paramd has no flag --no_such_flag",
            r"BAD\.md:38: hpctl has no command 'frobnicate'",
            r"BAD\.md:39: hpctl load has no flag --no_such_option",
            r"BAD\.md:40: hybrid-paramd-health has no flag --bogus",
            r"BAD\.md:43: unknown doc-test decision 'maybe'",
            r"BAD\.md:48: 'skip' needs what follows the colon",
            r"BAD\.md:53: a doc-test marker that is not on the line right before a fence",
            r"BAD\.md:56: a doc-test marker on a python block",
            r"BAD\.md:62: the output of `echo never ran`, which no run block above ran",
            r"BAD\.md:69: `echo \"value 41\"` did not print 'value 42'",
        ]
        for rx in expected:
            self.assertRegex(out, rx)
        self.assertEqual(len(re.findall(r"^FAIL ", out, re.M)), len(expected), out)
        # The command after the failing one did not run.
        self.assertFalse(os.path.exists(after))
        # --no_run still finds the markers and the static problems.
        rc, out = self.fx.run("BAD.md", args=("--no_run",))
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL BAD.md:3: a sh block without a doc-test marker", out)
        self.assertIn("FAIL BAD.md:38: hpctl has no command 'frobnicate'", out)
        self.assertNotIn("exited", out)

    def test_a_block_that_times_out_is_ended(self):
        write(os.path.join(self.fx.root, "SLOW.md"),
              "<!-- doc-test: run -->\n```sh\necho start\nsleep 30\n```\n")
        rc, out = self.fx.run("SLOW.md", args=("--timeout", "1"))
        self.assertEqual(rc, 1, out)
        self.assertIn("SLOW.md:4: `sleep 30`: timed out after 1 s", out)


    def test_killed_doc_test_ends_its_block(self):
        pidfile = os.path.join(self.fx.dir, "sleeper.pid")
        write(os.path.join(self.fx.root, "HANG.md"),
              "<!-- doc-test: run -->\n```sh\nsleep 300 & echo $! > \"$FIXTURE_PIDFILE\"\n"
              "sleep 300\n```\n")
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "doc_test.py"), "--root",
                                 self.fx.root, "--bin_dir", self.fx.bin, "HANG.md"],
                                stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, FIXTURE_PIDFILE=pidfile,
                                         TMPDIR=self.fx.dir))
        for _ in range(100):
            if os.path.exists(pidfile) and os.path.getsize(pidfile):
                break
            time.sleep(0.1)
        with open(pidfile) as f:
            pid = int(f.read())
        proc.terminate()
        self.assertEqual(proc.wait(timeout=30), 143)
        proc.stdout.close()
        self.assertGone(pid)
        self.assertEqual([d for d in os.listdir(self.fx.dir) if d.startswith("doc-test-")], [])


class ExtractorTest(unittest.TestCase):
    def test_commands_join_continuations_and_open_constructs(self):
        lines = textwrap.dedent("""\
            # a comment line
            a --x \\
              --y   # trailing comment

            (umask 077
             for r in a b; do echo "$r"; done > f)
            echo "two
            lines"
            if true
            then echo x
            fi
            b &&
              c
            echo if done
            """).splitlines()
        got = [(c.index, doc_test.normalize(c.text)) for c in doc_test.split_commands(lines)]
        self.assertEqual(got, [
            (1, "a --x --y"),
            (4, "( umask 077 for r in a b ; do echo $r ; done > f )"),
            (6, "echo two\nlines"),
            (8, "if true then echo x fi"),
            (11, "b && c"),
            (13, "echo if done"),
        ])

    def test_console_blocks(self):
        cmds = doc_test.console_commands(["$ echo a \\", "  b", "a b", "$ true", "", "text"])
        self.assertEqual([(c.index, c.text, c.expected) for c in cmds],
                         [(0, "echo a \\\n  b", ["a b"]), (3, "true", ["text"])])

    def test_durations_are_free_other_numbers_exact(self):
        rx = doc_test.line_pattern("step time: mean 84.9 ms; wall 6.0 s; loss 2.8080 (30 steps)")
        self.assertTrue(rx.fullmatch("step time: mean 1.2 ms; wall 16.5 s; loss 2.8080 (30 steps)"))
        self.assertFalse(rx.fullmatch("step time: mean 1.2 ms; wall 16.5 s; loss 2.8081 (30 steps)"))
        self.assertFalse(rx.fullmatch("step time: mean 1.2 ms; wall 16.5 s; loss 2.8080 (31 steps)"))

    def test_simple_commands_drop_redirection_targets(self):
        self.assertEqual(
            doc_test.simple_commands("printf '%s' $(openssl rand) > /etc/x && sudo hpctl status "
                                     "2>&1 | tee log; hpctl load [--force]"),
            [["printf", "%s", "$"], ["openssl", "rand"], ["sudo", "hpctl", "status", "2"],
             ["tee", "log"], ["hpctl", "load", "--force"]])


if __name__ == "__main__":
    unittest.main()
