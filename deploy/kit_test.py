#!/usr/bin/env python3
"""//deploy:kit_test: every deployment the kit ships forms a working cluster
as shipped.

For systemd, Kubernetes, the container image and Slurm it reads the shipped
files (the unit and its flag and environment files; the manifests, their
ConfigMap and the README's Secrets; the Dockerfile's ENTRYPOINT and the
README's `docker run` lines; the sbatch launcher, run under a fake `srun`
and `scontrol`), starts those command lines as local processes, and then
drives the cluster with hpctl: load (or check the model a command line
loads), step, fetch, checkpoint, export, each checked for its effect; then
SIGTERM, and every process must exit 0. The only changes between a file and
the process are the mechanical ones below (SUBSTITUTIONS), each a thing a
test on one machine needs and an operator would not do. A deployment that
does not work fails the test, naming the file and line of the flags the
processes' errors point at (or of the command line that failed).

  kit_test.py HYBRID_PARAMD HPCTL HEALTH MAKE_CERTS [--only=systemd,k8s,docker,slurm]
              [--preset=small|demo] [--no-mutants] [--keep]

Mutants: a copy of the kit with one broken port must fail, naming the line.
Run from the repository root (Bazel runs it in the runfiles tree).
"""

import atexit
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_deploy as cd  # noqa: E402  (the static checks' parsers)

# SUBSTITUTIONS (the only differences between a shipped file and what runs):
#  * Install paths: /usr/local/bin/hybrid-paramd (and -health) -> the binaries
#    under test; absolute paths (/etc/..., /var/lib/..., /run/..., /shared/...)
#    -> the same path below a temporary root; Kubernetes volumes and docker
#    bind mounts -> temporary directories with the same file names.
#  * Host names -> loopback addresses, one per machine (systemd's hosts
#    127.30.0.N, Kubernetes pods 127.77.S.P, Slurm nodes 127.20.0.N): a
#    wildcard listen on a fixed port binds the machine's address (machines
#    have their own ports; here they share one), 127.0.0.1 inside a pod is
#    the pod's, a docker port published on every interface is published on
#    127.0.0.1. A listen on port 0 stays as it is: a daemon's data plane on
#    0.0.0.0:0 advertises the host of its --advertise_address, its machine's
#    address here. The certificate names these addresses and nothing else
#    (a data plane dialled at this machine's own name fails its handshake).
#  * systemd specifiers: %i -> the instance, %d / $CREDENTIALS_DIRECTORY -> a
#    directory holding 0600 copies of the LoadCredential= files.
#  * Kubernetes: the Downward API (metadata.name -> <statefulset>-<ordinal>,
#    metadata.namespace -> "default", as the README's commands use) and
#    $(VAR) expansion, which the kubelet does; init containers run as local
#    commands; `kubectl port-forward` -> the coordinator pod's address.
#  * No GPU on CI: --backend=gpu -> cpu and --data_plane=nccl -> host (the
#    GPU paths have their own tests, tools/gpu_test.sh).
#  * Slurm: srun and scontrol are fakes (this file) that run each step as a
#    local process, recording its exit code; the trainer command is this
#    file too, waiting until the test has driven the cluster.
#  * The model file a load names (a path every daemon sees) -> its host path.
NAMESPACE = "default"
NO_GPU = {"backend": ("gpu", "cpu"), "data_plane": ("nccl", "host")}
# The model: `hpctl generate --preset small` (0.3 MB). The README's `demo`
# (77 MB, --preset=demo) drives the same paths (the daemons' data plane
# included) but costs ~10 s of both cores per cluster; on a loaded CI
# machine that starves the daemons' handshakes.
PRESET = "small"
START_TIMEOUT = 40  # seconds for a cluster to form (~1 s alone; CI shares 2 cores)
MUTANT_START_TIMEOUT = 8
HPCTL_TIMEOUT = 180
STOP_TIMEOUT = 30

PROCS = []  # every process started, killed on any exit
OUT = threading.local()  # a lane's output, printed as a whole


def say(text):
    lines = getattr(OUT, "lines", None)
    if lines is None:
        print(text, flush=True)
    else:
        lines.append(str(text))


class KitError(Exception):
    """A deployment that does not work as shipped; the message names the
    file and line."""


# ---------------------------------------------------------------- processes


class Proc:
    """One started process: its argv, where each argument comes from
    (FILE:LINE), and its log."""

    def __init__(self, name, argv, origins, logdir, env=None, cwd=None):
        self.name, self.argv, self.origins = name, argv, origins
        self.env, self.cwd = env, cwd
        self.log = os.path.join(logdir, name.replace("/", "_") + ".log")
        self.popen = None
        self.rc = None

    def start(self):
        with open(self.log, "w") as log:
            env = dict(os.environ, **(self.env or {}))
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=self.cwd, start_new_session=True)
        PROCS.append(self)
        return self

    def poll(self):
        if self.rc is None and self.popen is not None:
            self.rc = self.popen.poll()
        return self.rc

    def text(self):
        try:
            return open(self.log, errors="replace").read()
        except OSError:
            return ""


def kill(procs):
    """SIGKILL to what is left of `procs` and everything they started."""
    for p in procs:
        if p.popen is not None and p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except OSError:
                pass
            p.popen.wait()


def kill_all():
    kill(PROCS)


def stop(procs, what):
    """SIGTERM to every process at once (as `systemctl stop`, `kubectl
    delete`, the end of a job do); each must exit 0."""
    for p in procs:
        if p.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.time() + STOP_TIMEOUT
    for p in procs:
        try:
            p.rc = p.popen.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            raise KitError(f"{what}: {p.name} did not exit within {STOP_TIMEOUT} s of SIGTERM "
                           f"(started from {first_origin(p)})\n{diagnose(procs)}")
        if p.rc != 0:
            raise KitError(f"{what}: {p.name} exited {p.rc} after SIGTERM, want 0 (started from "
                           f"{first_origin(p)})\n{diagnose(procs)}")


def first_origin(p):
    return p.origins[0][1] if p.origins else "?"


def flag_value(p, name):
    """The value `p` runs with for --name (the last one), or None."""
    values = [cd.parse_flag(arg)[1] for arg, _, _ in p.origins if (cd.parse_flag(arg) or ("",))[0] == name]
    return values[-1] if values else None


def flag_origins(p, name):
    """Where `p`'s flag --name comes from: "FILE:LINE: --name=VALUE", the
    last one (it wins) first."""
    found = [f"{origin}: {shipped}" for arg, origin, shipped in p.origins
             if (cd.parse_flag(arg) or ("",))[0] == name]
    return "; ".join(reversed(found)) or f"(no --{name})"


ERROR_LINE = re.compile(r"\b(ERROR|FATAL|WARN|WARNING|E\d{4})\b|error|refused|failed|cannot|not ")


def diagnose(procs):
    """What the processes say: for each, running or its exit code, the
    error lines of its log and the file lines of the flags they name (by
    name, or by the HOST:PORT value)."""
    out, suspects = [], []
    bad = {p.name: [l for l in p.text().splitlines() if ERROR_LINE.search(l)] for p in procs}
    everyone = "\n".join(l for lines in bad.values() for l in lines)
    for p in procs:
        own = "\n".join(bad[p.name])
        for arg, origin, shipped in p.origins:
            parsed = cd.parse_flag(arg)
            if not parsed:
                continue
            # Named in its own errors, or its address in anyone's.
            name, value = parsed
            named = re.search(rf"--{re.escape(name)}\b", own)
            if not named and value and cd.host_port(value)[0] not in (None, "0.0.0.0"):
                named = value in everyone and not value.endswith(":0")
            if named and f"{origin}: {shipped}" not in suspects:
                suspects.append(f"{origin}: {shipped}")
        state = "running" if p.poll() is None else f"exited {p.rc}"
        out.append(f"  {p.name} ({state}; command from {first_origin(p)}):")
        out += [f"    {l}" for l in bad[p.name][-6:]]
    if suspects:
        out.insert(0, "  the lines the errors point at:\n" + "\n".join(f"    {s}" for s in suspects))
    return "\n".join(out)


def print_logs(procs):
    if getattr(OUT, "quiet", False):
        return
    for p in procs:
        lines = p.text().splitlines()
        say(f"---- log of {p.name} ({len(lines)} lines, last 40): {' '.join(p.argv)}")
        for l in lines[-40:]:
            say(f"  {l}")


def wait_for(condition, timeout, procs, what, explain=None):
    """Polls condition() until true; a process of `procs` that exits, or the
    timeout, fails (with explain(): what condition() saw last)."""
    deadline = time.time() + timeout
    while True:
        result = condition()
        if result:
            return result
        for p in procs:
            if p.poll() is not None:
                raise KitError(f"{what}: {p.name} exited {p.rc} (started from {first_origin(p)})\n"
                               f"{diagnose(procs)}")
        if time.time() > deadline:
            seen = explain() if explain else ""
            raise KitError(f"{what}: not within {timeout} s{': ' + seen if seen else ''}\n{diagnose(procs)}")
        time.sleep(0.2)


def port_free(host, port):
    """Whether HOST:PORT can be bound (with SO_REUSEADDR, as gRPC binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_ports_free(procs, what):
    """The files' fixed ports must be free here, or another process on this
    machine (a parallel test) holds them: say so instead of a confusing
    failure."""
    for p in procs:
        for arg, origin, shipped in p.origins:
            parsed = cd.parse_flag(arg)
            if not parsed or not parsed[0].endswith("listen") or not parsed[1]:
                continue
            host, port = cd.host_port(parsed[1])
            if port and not port_free(host, port):
                raise KitError(f"{what}: {host}:{port} ({origin}: {shipped}) is in use by another process "
                               "on this machine, not by this test: run the test alone")


# ---------------------------------------------------------------- substitutions


class Machine:
    """Where a process runs: the host names it resolves, its own address
    (None: the shared 127.0.0.1) and how its paths map to this machine."""

    def __init__(self, hosts, paths, ip=None):
        self.hosts = hosts  # name -> address
        self.paths = paths  # function: absolute path -> local path
        self.ip = ip

    def value(self, value):
        if value.startswith("/"):
            return self.paths(value)
        host, port = cd.host_port(value)
        if host is None:
            return value
        if host in self.hosts:
            return f"{self.hosts[host]}:{port}"
        if self.ip and (host in ("127.0.0.1", "localhost") or (host == "0.0.0.0" and port != 0)):
            return f"{self.ip}:{port}"
        return value

    def arg(self, arg):
        """One argument: a --flag=VALUE's value substituted."""
        parsed = cd.parse_flag(arg)
        if not parsed or parsed[1] is None:
            return arg
        name, value = parsed
        if name in NO_GPU and value == NO_GPU[name][0]:
            return f"--{name}={NO_GPU[name][1]}"
        return f"--{name}={self.value(value)}"


def install_flagfile(source, rel, target, machine):
    """Copies the flagfile `source` (FILE `rel`, or text with line offset)
    to `target` with each flag substituted, line for line; returns
    (argument, FILE:LINE, shipped line) of each flag."""
    if isinstance(source, tuple):
        text, offset = source
    else:
        text, offset = open(source).read(), 0
    origins, out = [], []
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith("--"):
            new = machine.arg(stripped)
            origins.append((new, f"{rel}:{n + offset}", stripped))
            line = new
        out.append(line)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write("\n".join(out))
    return origins


def line_of(path, needle, after=None, start=1):
    """The number of the first line of `path` from line `start` containing
    `needle` (after the first line matching the regex `after`), else 0."""
    started = after is None
    for n, line in enumerate(open(path).read().split("\n"), 1):
        if n < start:
            continue
        if not started:
            started = re.search(after, line) is not None
            continue
        if needle in line:
            return n
    return 0


def private_copy(source, target, mode=0o600):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(source, target)
    os.chmod(target, mode)


# ---------------------------------------------------------------- the workload


def safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


class Hpctl:
    """hpctl as the operator runs it: connection flags, working directory."""

    def __init__(self, hpctl, connection, cwd, procs, label):
        self.hpctl, self.connection, self.cwd = hpctl, connection, cwd
        self.procs, self.label = procs, label

    def __call__(self, *args, want=0):
        argv = [self.hpctl, args[0], *self.connection, *args[1:]]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, cwd=self.cwd,
                               timeout=HPCTL_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise KitError(f"{self.label}: hpctl {' '.join(args)} did not finish in {HPCTL_TIMEOUT} s\n"
                           f"{diagnose(self.procs)}")
        out = (r.stdout + r.stderr).strip()
        if r.returncode != want:
            raise KitError(f"{self.label}: {' '.join(argv)} exited {r.returncode}:\n  {out[-1500:]}\n"
                           f"{diagnose(self.procs)}")
        return out

    def status(self):
        return json.loads(self("status", "--json", "--noshards"))


def health(tools, address, tls_ca, service=None, wait=2):
    argv = [tools["health"], f"--address={address}", f"--wait={wait}", "--quiet"]
    if tls_ca:
        argv.append(f"--tls_ca={tls_ca}")
    if service:
        argv.append(f"--service={service}")
    return subprocess.run(argv, capture_output=True, text=True).returncode == 0


def exercise(label, tools, procs, hpctl, address, tls_ca, daemons, model, load_path=None,
             checkpoint_dir=None, ready=None, formed=None, explain=None, start_timeout=START_TIMEOUT):
    """Drives a started cluster: formed (every daemon joined), the model
    loaded (by `hpctl load load_path`, or already by the command line), a
    step, a fetch, a checkpoint and an export, each checked for its effect.
    `ready()`: extra readiness (e.g. the pods' probes) once loaded."""
    start = time.time()

    def not_joined():  # the daemons the coordinator does not list, and why
        try:
            status = json.loads(hpctl("status", "--json", "--noshards", "--timeout=3"))
        except KitError:
            return f"the coordinator does not answer at {address}"
        joined = {m.get("address") for m in status.get("members", []) if m.get("role") == "ROLE_DAEMON"}
        coordinator = next((p for p in procs if flag_value(p, "role") in ("coordinator", "both")), None)
        why = [f"{p.name} has not joined: it dials {flag_origins(p, 'coordinator')}; the coordinator listens at "
               f"{flag_origins(coordinator, 'listen') if coordinator else '?'}"
               for p in procs if flag_value(p, "role") == "daemon" and flag_value(p, "advertise_address") not in joined]
        if status.get("expected_daemons", 0) > daemons and coordinator:
            why.append(f"the coordinator expects {status['expected_daemons']} daemons "
                       f"({flag_origins(coordinator, 'daemons')}), {daemons} started")
        return "; ".join(why)

    wait_for(formed or (lambda: health(tools, address, tls_ca, "paramd.rpc.Coordinator")),
             start_timeout, procs, f"{label}: the coordinator at {address} has every daemon joined",
             explain or not_joined)
    tensors = sorted(safetensors_header(model).keys() - {"__metadata__"})
    status = hpctl.status()
    joined = [m for m in status.get("members", []) if m.get("role") == "ROLE_DAEMON"]
    if status.get("expected_daemons") != daemons or len(joined) != daemons:
        raise KitError(f"{label}: the coordinator expects {status.get('expected_daemons')} daemons and "
                       f"{len(joined)} joined; {daemons} were started\n{diagnose(procs)}")
    if load_path:
        hpctl("load", load_path)
    else:
        wait_for(lambda: health(tools, address, tls_ca), start_timeout, procs,
                 f"{label}: the model of the command line loaded (health SERVING)")
    status = hpctl.status()
    loaded = sorted(t["name"] for t in status.get("manifest", {}).get("tensors", []))
    if loaded != tensors or int(status.get("committed_version", 0)) != 0:
        raise KitError(f"{label}: after the load the cluster holds {len(loaded)} tensors at version "
                       f"{status.get('committed_version', 0)}, want the model's {len(tensors)} at 0")
    if ready:
        ready()
    out = hpctl("step")
    committed = int(hpctl.status().get("committed_version", 0))
    if committed != 1:
        raise KitError(f"{label}: after `hpctl step` ({out}) the committed version is {committed}, want 1")
    work = tempfile.mkdtemp(prefix="hpctl-", dir=hpctl.cwd)
    fetched = os.path.join(work, "fetched.safetensors")
    hpctl("fetch", tensors[0], "--out", fetched)
    meta = safetensors_header(fetched).get("__metadata__", {})
    if meta.get("tensor") != tensors[0] or meta.get("version") != "1":
        raise KitError(f"{label}: hpctl fetch {tensors[0]} wrote {meta}, want version 1 of it")
    hpctl("checkpoint")
    manifest = os.path.join(checkpoint_dir, "v1", "MANIFEST")
    if not os.path.isfile(manifest):
        raise KitError(f"{label}: hpctl checkpoint succeeded but {manifest} does not exist "
                       f"({os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else 'no dir'})")
    if "v1" not in hpctl("checkpoint", "list"):
        raise KitError(f"{label}: hpctl checkpoint list does not list v1")
    exported = os.path.join(work, "export")
    hpctl("export", "--out", exported)
    index = json.load(open(os.path.join(exported, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    if sorted(index["weight_map"]) != tensors or not all(
            os.path.getsize(os.path.join(exported, s)) > 0 for s in shards):
        raise KitError(f"{label}: hpctl export wrote {sorted(index['weight_map'])[:5]}... in {shards}, "
                       f"want the model's {len(tensors)} tensors")
    say(f"{label}: formed, loaded {len(tensors)} tensors, stepped to version 1, fetched {tensors[0]}, "
          f"checkpointed {manifest}, exported {len(shards)} shard(s) in {time.time() - start:.1f} s")


# ---------------------------------------------------------------- shared setup


class Setup:
    """What every deployment shares: the binaries, certificates and tokens
    (deploy/README.md, "Certificates and tokens"), the generated model."""

    def __init__(self, tools, tmp, preset):
        self.tools, self.tmp = tools, tmp
        self.certs = os.path.join(tmp, "certs")
        self.model = os.path.join(tmp, "model", "demo.safetensors")
        os.makedirs(os.path.dirname(self.model))
        run([tools["hpctl"], "generate", "--out", self.model, "--preset", preset])
        # Every address a process is dialled at (see SUBSTITUTIONS).
        names = ["IP:127.0.0.1", "DNS:localhost"]
        names += [f"IP:{net}.{s}.{p}" for net in ("127.77", "127.78") for s in range(1, 4) for p in range(1, 9)]
        names += [f"IP:{net}.{n}" for net in ("127.20.0", "127.30.0", "127.31.0") for n in range(1, 9)]
        run(["bash", tools["make_certs"], self.certs, ",".join(names)])
        fd = os.open(os.path.join(self.certs, "tokens"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, "".join(f"{role} {os.urandom(32).hex()}\n"
                             for role in ("cluster", "operator", "trainer")).encode())
        os.close(fd)

    def cert(self, name):
        return os.path.join(self.certs, name)


def run(argv, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}): {r.stdout}{r.stderr}")
    return r.stdout


def rel(kit, path):
    return os.path.relpath(path, kit)


def readme_section(kit, title):
    """(text, line offset) of the README section `### title...`: its line
    k is the file's line k + offset."""
    path = os.path.join(kit, "deploy", "README.md")
    text = open(path).read()
    start = text.find(f"\n### {title}")
    if start < 0:
        raise KitError(f"deploy/README.md: no section '### {title}'")
    end = text.find("\n### ", start + 1)
    # The section's line 1 is the end of the line before the heading.
    return text[start:end if end > 0 else len(text)], text[:start].count("\n")


def readme_commands(kit, title, prefix):
    """(README line, words) of each `prefix ...` command in the section."""
    section, offset = readme_section(kit, title)
    return [(n + offset, words) for n, words in cd.command_lines(section, prefix)]


def hpctl_connection(words, host_map):
    """The connection flags (--address, --tls_ca, --auth_token_file) of an
    hpctl command line of the README, host names substituted."""
    connection, i = [], 0
    while i < len(words):
        w = words[i]
        name, eq, value = w.partition("=")
        if name in ("--address", "--tls_ca", "--auth_token_file"):
            if not eq:
                i += 1
                value = words[i]
            if name == "--address":
                host, port = cd.host_port(value)
                value = f"{host_map.get(host, host)}:{port}"
            connection.append(f"{name}={value}")
        i += 1
    return connection


# ---------------------------------------------------------------- systemd


def systemd(kit, setup, label="systemd", start_timeout=START_TIMEOUT, net="127.30.0"):
    """deploy/systemd as the README installs it: its install commands (flag,
    environment, recipe and credential files under /etc/hybrid-paramd), then
    the unit's ExecStart for every instance its `systemctl enable` starts,
    with the unit's credentials, environment files and state directory."""
    directory = os.path.join(kit, "deploy", "systemd")
    unit_path = os.path.join(directory, "hybrid-paramd@.service")
    unit_rel = rel(kit, unit_path)
    directives = cd.unit_directives(open(unit_path).read())
    root = tempfile.mkdtemp(prefix="systemd-", dir=setup.tmp)

    def local(path):  # an absolute path of the machine -> below the root
        return root + path

    def one(key):
        found = [(v, n) for k, v, n in directives if k == key]
        return found[0] if found else (None, 0)

    # Host names in the kit's flags -> one address each (see SUBSTITUTIONS).
    hosts = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".flags"):
            for arg in cd.flagfile_args(open(os.path.join(directory, name)).read(), name):
                host, _ = cd.host_port(cd.parse_flag(arg)[1] or "")
                if host and not re.match(r"^[\d.]+$", host) and host not in hosts:
                    hosts[host] = f"{net}.{len(hosts) + 1}"

    # The README's install commands (sudo install / cp into /etc, below the
    # root; the flag files with the substitutions, which stand for its
    # "edit hosts"), and the instances its `systemctl enable` starts.
    os.symlink(setup.certs, os.path.join(root, "certs"))
    flagfiles, instances = {}, []
    for line, words in readme_commands(kit, "systemd", "sudo"):
        command, args = words[1], words[2:]
        if command == "systemctl" and args[:1] == ["enable"]:
            instances += [w.split("@", 1)[1].removesuffix(".service") for w in args
                          if w.startswith("hybrid-paramd@")]
        if command not in ("install", "cp"):
            continue
        mode, make_dirs, paths, i = None, False, [], 0
        while i < len(args):
            if args[i] == "-m":
                mode, i = int(args[i + 1], 8), i + 1
            elif args[i] == "-d":
                make_dirs = True
            else:
                paths.append(args[i])
            i += 1
        if make_dirs:
            for d in paths:
                os.makedirs(local(d), mode=mode or 0o755, exist_ok=True)
            continue
        target = paths[-1]
        for source in paths[:-1]:
            if source.startswith("bazel-bin/") or not target.startswith("/etc/hybrid-paramd"):
                continue  # the binaries (the ones under test) and the unit (read from the kit)
            found = sorted(glob.glob(os.path.join(kit, source)) if not source.startswith("certs/")
                           else [os.path.join(root, source)])
            if not found:
                raise KitError(f"deploy/README.md:{line}: {source} does not exist")
            for path in found:
                dest = local(os.path.join(target, os.path.basename(path)) if target.endswith("/") else target)
                shutil.copyfile(path, dest)
                if path.endswith(".flags"):
                    flagfiles[os.path.basename(path)[: -len(".flags")]] = (path, dest)
                if mode is not None:
                    os.chmod(dest, mode)
    if not instances:
        raise KitError("deploy/README.md: no `systemctl enable` of hybrid-paramd@ instances in the systemd section")
    for instance in instances:
        if instance not in flagfiles:
            raise KitError(f"deploy/README.md: `systemctl enable` starts hybrid-paramd@{instance}, but no install "
                           f"line puts {instance}.flags in /etc/hybrid-paramd")
    # Each instance's machine: a daemon's is the host it advertises, the
    # coordinator's the host the daemons dial; its flag files substituted
    # for it (the README's "edit hosts").
    raw = {i: dict(cd.parse_flag(a) for a in cd.flagfile_args(open(f[0]).read(), f[0]))
           for i, f in flagfiles.items()}
    dialled = next((v["coordinator"] for v in raw.values() if v.get("role") == "daemon" and "coordinator" in v),
                   "127.0.0.1:7070")
    machines, origins_of = {}, {}
    for instance, (source, dest) in flagfiles.items():
        host = cd.host_port(raw[instance].get("advertise_address") if raw[instance].get("role") == "daemon"
                            else dialled)[0]
        machines[instance] = Machine(hosts, local, hosts.get(host))
        origins_of[instance] = install_flagfile(source, rel(kit, source), dest, machines[instance])

    exec_start, exec_line = one("ExecStart")
    if exec_start is None:
        raise KitError(f"{unit_rel}: no ExecStart")
    working_dir, _ = one("WorkingDirectory")
    state_dir, _ = one("StateDirectory")
    kill_signal, kill_line = one("KillSignal")
    if kill_signal not in (None, "SIGTERM", "TERM", "15"):
        raise KitError(f"{unit_rel}:{kill_line}: KillSignal={kill_signal}; hybrid-paramd exits 0 on SIGTERM")
    logdir = os.path.join(root, "log")
    os.makedirs(logdir)
    procs = []
    for instance in instances:
        # Credentials: systemd's private copies; %d is their directory.
        creds_path = f"/run/credentials/hybrid-paramd@{instance}.service"
        creds = local(creds_path)
        for k, v, n in directives:
            if k == "LoadCredential":
                name, _, path = v.partition(":")
                source = local(path.replace("%i", instance))
                if not os.path.exists(source):
                    raise KitError(f"{unit_rel}:{n}: LoadCredential={v}: {path} is not a file the README "
                                   "installs: the unit does not start")
                private_copy(source, os.path.join(creds, name))

        def specifiers(word):
            word = re.sub(r"\$\{?CREDENTIALS_DIRECTORY\}?", creds_path, word)
            for spec in set(re.findall(r"%.", word)) - {"%i", "%I", "%d", "%%"}:
                raise KitError(f"{unit_rel}:{exec_line}: specifier {spec} is not emulated by this test")
            return (word.replace("%i", instance).replace("%I", instance).replace("%d", creds_path)
                    .replace("%%", "%"))

        machine = machines.get(instance, Machine(hosts, local))
        words = shlex.split(exec_start)
        if os.path.basename(words[0]) != "hybrid-paramd":
            raise KitError(f"{unit_rel}:{exec_line}: ExecStart runs {words[0]}, not hybrid-paramd")
        argv, origins = [setup.tools["binary"]], []
        for word in words[1:]:
            arg = machine.arg(specifiers(word))
            argv.append(arg)
            origins.append((arg, f"{unit_rel}:{line_of(unit_path, word, start=exec_line) or exec_line}", word))
            if arg.startswith("--flagfile="):
                origins += origins_of.get(instance, [])
        env = {"CREDENTIALS_DIRECTORY": creds}
        for k, v, n in directives:
            if k == "EnvironmentFile":
                path = local(v.lstrip("-").replace("%i", instance))
                if os.path.exists(path):
                    env.update(l.split("=", 1) for l in open(path).read().splitlines()
                               if "=" in l and not l.lstrip().startswith(("#", ";")))
                elif not v.startswith("-"):
                    raise KitError(f"{unit_rel}:{n}: EnvironmentFile={v} is missing for {instance}")
            elif k == "Environment":
                env.update(w.split("=", 1) for w in shlex.split(v) if "=" in w)
        if state_dir:
            os.makedirs(local(f"/var/lib/{state_dir}"), exist_ok=True)
        cwd = local(working_dir) if working_dir else root
        os.makedirs(cwd, exist_ok=True)
        procs.append(Proc(f"hybrid-paramd@{instance}", argv, origins, logdir, env, cwd))

    values = {p.name: dict(cd.parse_flag(a) for a, _, _ in p.origins if cd.parse_flag(a)) for p in procs}
    daemons = [p for p in procs if values[p.name].get("role") == "daemon"]
    coordinator_instance = next((i for i in instances if raw.get(i, {}).get("role") == "coordinator"), None)
    if coordinator_instance is None:
        raise KitError(f"deploy/README.md: `systemctl enable` starts no coordinator instance ({instances})")
    cmachine = machines[coordinator_instance]
    # hpctl on the coordinator's machine: its --listen port there.
    coordinator = cmachine.value("127.0.0.1:" + str(cd.host_port(raw[coordinator_instance].get(
        "listen", "127.0.0.1:7070"))[1]))
    check_ports_free(procs, label)
    for p in procs:
        p.start()
    try:
        # hpctl as the README says: the coordinator's address, the CA and
        # the token file ("Certificates and tokens").
        hpctl = Hpctl(setup.tools["hpctl"], [f"--address={coordinator}", f"--tls_ca={setup.cert('ca.pem')}",
                                             f"--auth_token_file={setup.cert('tokens')}"], root, procs, label)
        checkpoint_dir = values[f"hybrid-paramd@{coordinator_instance}"].get("checkpoint_dir")

        def ready():  # the README's health check, in the directory of certs/
            for line, words in readme_commands(kit, "systemd", "hybrid-paramd-health"):
                args = [cmachine.arg(w) for w in words[1:] if not w.startswith("--wait=")]
                r = subprocess.run([setup.tools["health"], *args, "--wait=30"], capture_output=True,
                                   text=True, cwd=root)
                if r.returncode != 0:
                    raise KitError(f"deploy/README.md:{line}: {' '.join(words)}: {r.stdout}{r.stderr}")

        exercise(label, setup.tools, procs, hpctl, coordinator, setup.cert("ca.pem"), len(daemons),
                 setup.model, load_path=setup.model, checkpoint_dir=checkpoint_dir, ready=ready,
                 start_timeout=start_timeout)
        stop(procs, label)
    finally:
        settle(procs)


def settle(procs):
    """Kills what is left of `procs` (after a failure), logs printed."""
    if any(p.poll() is None for p in procs) or any(p.rc not in (0, None) for p in procs):
        print_logs(procs)
    kill(procs)


# ---------------------------------------------------------------- Kubernetes


def dockerfile_image(kit):
    """The image's ENTRYPOINT, CMD and WORKDIR (deploy/docker/Dockerfile)."""
    path = os.path.join(kit, "deploy", "docker", "Dockerfile")
    image = {"file": rel(kit, path)}
    for n, line in enumerate(open(path).read().split("\n"), 1):
        m = re.match(r"^(ENTRYPOINT|CMD|WORKDIR)\s+(.*)$", line.strip())
        if m:
            value = json.loads(m.group(2)) if m.group(2).startswith("[") else m.group(2)
            image[m.group(1)] = (value, n)
    if "ENTRYPOINT" not in image:
        raise KitError(f"{image['file']}: no ENTRYPOINT")
    return image


def image_path(tools, path):
    """The binaries the image installs in /usr/local/bin."""
    if path.startswith("/usr/local/bin/"):
        name = os.path.basename(path)
        if name in ("hybrid-paramd", "hybrid-paramd-health", "hpctl"):
            return tools[{"hybrid-paramd": "binary", "hybrid-paramd-health": "health"}.get(name, name)]
    return None


def container_start(c):
    """A regex for the line where container `c` starts in its manifest."""
    return rf"^\s*- name: {re.escape(c['name'])}\s*$"


def readme_secrets(kit):
    """The Secrets the README creates: name -> file names (basenames of
    `kubectl create secret generic NAME --from-file=...`)."""
    secrets = {}
    for _, words in readme_commands(kit, "Kubernetes", "kubectl"):
        if words[1:4] == ["create", "secret", "generic"]:
            files = [w.split("=", 1)[1] for w in words[5:] if w.startswith("--from-file=")]
            secrets[words[4]] = files
    return secrets


def k8s(kit, setup, label="k8s", start_timeout=START_TIMEOUT, net="127.77"):
    """deploy/k8s as `kubectl apply` runs it: every StatefulSet's pods, each
    with its volumes (ConfigMap files, the README's Secrets, emptyDirs, the
    PVC), its init containers, then its container (the image's ENTRYPOINT
    and the args, env from the Downward API); hpctl through the
    coordinator Service as the README's port-forward does."""
    directory = os.path.join(kit, "deploy", "k8s")
    before = len(cd.PROBLEMS)
    objects = cd.load_k8s(directory)
    problems = [p for p in cd.PROBLEMS[before:] if p.startswith(directory)]
    if problems:
        raise KitError("; ".join(problems))
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    services = by_kind.get("Service", {})
    configmaps = by_kind.get("ConfigMap", {})
    image = dockerfile_image(kit)
    secrets = readme_secrets(kit)
    root = tempfile.mkdtemp(prefix="k8s-", dir=setup.tmp)
    logdir = os.path.join(root, "log")
    os.makedirs(logdir)

    # Pods and their addresses; the names DNS gives them (headless Services
    # that publish not-ready addresses: other Services route only to ready
    # pods, and these processes must reach each other before they are).
    pods = []
    for s, (name, sts) in enumerate(sorted(by_kind.get("StatefulSet", {}).items()), 1):
        for ordinal in range(sts["spec"].get("replicas", 1)):
            pods.append({"sts": sts, "name": f"{name}-{ordinal}", "ip": f"{net}.{s}.{ordinal + 1}"})
    dns = {}
    for svc_name, svc in services.items():
        spec = svc["spec"]
        if spec.get("clusterIP") != "None" or not spec.get("publishNotReadyAddresses"):
            continue
        selected = [p for p in pods if cd.matches(spec.get("selector"), p["sts"]["spec"]["template"]["metadata"]["labels"])]
        if selected:
            for name in (svc_name, f"{svc_name}.{NAMESPACE}", f"{svc_name}.{NAMESPACE}.svc",
                         f"{svc_name}.{NAMESPACE}.svc.cluster.local"):
                dns[name] = selected[0]["ip"]
        for p in selected:
            if p["sts"]["spec"].get("serviceName") == svc_name:
                for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.cluster.local"):
                    dns[f"{p['name']}.{svc_name}{suffix}"] = p["ip"]

    procs, probes, roles = [], [], {}
    pvc_root = os.path.join(root, "pvc")
    for pod in pods:
        sts = pod["sts"]
        sts_file = sts["_file"]
        sts_rel = rel(kit, sts_file)
        spec = sts["spec"]["template"]["spec"]
        pod_root = os.path.join(root, "pods", pod["name"])
        volumes = {}
        for v in spec.get("volumes", []):
            where = f"{sts_rel}:{line_of(sts_file, 'name: ' + v['name'], 'volumes:')}"
            path = os.path.join(pod_root, "volumes", v["name"])
            if "configMap" in v:
                cm = configmaps.get(v["configMap"]["name"])
                if cm is None:
                    raise KitError(f"{where}: volume {v['name']}: no ConfigMap {v['configMap']['name']}")
                os.makedirs(path)
                for key, value in cm.get("data", {}).items():
                    with open(os.path.join(path, key), "w") as f:
                        f.write(value)
            elif "secret" in v:
                name = v["secret"]["secretName"]
                if name not in secrets:
                    raise KitError(f"{where}: Secret {name} is not one deploy/README.md creates "
                                   f"({', '.join(secrets) or 'none'})")
                os.makedirs(path)
                # A Secret volume's files: defaultMode (0644), group-readable
                # with an fsGroup.
                mode = v["secret"].get("defaultMode", 0o644)
                if spec.get("securityContext", {}).get("fsGroup") is not None:
                    mode |= 0o040
                for f in secrets[name]:
                    private_copy(setup.cert(os.path.basename(f)), os.path.join(path, os.path.basename(f)), mode)
            elif "emptyDir" in v:
                os.makedirs(path)
            elif "persistentVolumeClaim" in v:
                path = os.path.join(pvc_root, v["persistentVolumeClaim"]["claimName"])
                os.makedirs(path, exist_ok=True)
            else:
                raise KitError(f"{where}: volume {v['name']}: a kind this test does not emulate")
            volumes[v["name"]] = path

        def mounts_of(c):
            return sorted(((m["mountPath"].rstrip("/"), volumes[m["name"]]) for m in c.get("volumeMounts", [])),
                          key=lambda m: -len(m[0]))

        for ic in spec.get("initContainers", []):
            mounts = mounts_of(ic)
            # The mount paths in its words (a shell command's too), in one pass.
            pattern = re.compile("|".join(re.escape(t) for t, _ in mounts) or "$^")
            words = [pattern.sub(lambda m: dict(mounts)[m.group(0)], w)
                     for w in ic.get("command", []) + ic.get("args", [])]
            r = subprocess.run(words, capture_output=True, text=True, cwd=pod_root)
            if r.returncode != 0:
                raise KitError(f"{sts_rel}:{line_of(sts_file, 'command:', 'initContainers:')}: init container "
                               f"{ic['name']} of {pod['name']} failed ({r.returncode}): {r.stdout}{r.stderr}")

        for c in spec.get("containers", []):
            mounts = mounts_of(c)
            workdir = os.path.join(pod_root, "workdir")
            os.makedirs(workdir, exist_ok=True)

            def paths(path, mounts=mounts, c=c):
                for target, source in mounts:
                    if path == target or path.startswith(target + "/"):
                        return source + path[len(target):]
                binary = image_path(setup.tools, path)
                if binary:
                    return binary
                raise KitError(f"{sts_rel}:{line_of(sts_file, path)}: {path} is in no volume container "
                               f"{c['name']} mounts")

            machine = Machine(dns, paths, pod["ip"])
            container_line = container_start(c)
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = str(e["value"])
                else:
                    field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                    known = {"metadata.name": pod["name"], "metadata.namespace": NAMESPACE,
                             "status.podIP": pod["ip"]}
                    if field not in known:
                        raise KitError(f"{sts_rel}:{line_of(sts_file, e['name'])}: env {e['name']} from "
                                       f"{e.get('valueFrom')}, which this test does not emulate")
                    env[e["name"]] = known[field]
            command = c.get("command") or image["ENTRYPOINT"][0]
            args = c.get("args") if "args" in c or "command" in c else image.get("CMD", ([], 0))[0]
            command = [cd.expand(w, env) for w in command]
            if os.path.basename(command[0]) != "hybrid-paramd":
                raise KitError(f"{sts_rel}: container {c['name']} runs {command[0]}, not hybrid-paramd")
            argv, origins = [setup.tools["binary"]], []
            for a in command[1:] + list(args or []):
                shipped = a
                a = machine.arg(cd.expand(a, env))
                argv.append(a)
                where = f"{sts_rel}:{line_of(sts_file, shipped, container_line)}"
                origins.append((a, where, shipped))
                parsed = cd.parse_flag(a)
                if parsed and parsed[0] == "flagfile":
                    # A ConfigMap file: substituted for this pod, in place.
                    cm_name = next((v["configMap"]["name"] for v in spec["volumes"]
                                    if "configMap" in v and parsed[1].startswith(volumes[v["name"]] + "/")), None)
                    key = os.path.basename(parsed[1])
                    cm = configmaps.get(cm_name, {})
                    if key not in cm.get("data", {}):
                        raise KitError(f"{where}: {shipped} is not a file of a mounted ConfigMap")
                    cm_file = cm["_file"]
                    offset = line_of(cm_file, f"{key}:")
                    origins += install_flagfile((cm["data"][key], offset), rel(kit, cm_file), parsed[1], machine)
            values = dict(cd.parse_flag(a) for a, _, _ in origins if cd.parse_flag(a))
            proc = Proc(f"{pod['name']}/{c['name']}", argv, origins, logdir, env, workdir)
            procs.append(proc)
            roles.setdefault(values.get("role", "both"), []).append((pod, c, values, machine, proc))
            readiness = c.get("readinessProbe", {}).get("exec", {}).get("command")
            if readiness:
                probes.append((pod["name"], [machine.value(w) if w.startswith("/") else machine.arg(w)
                                             for w in readiness],
                               f"{sts_rel}:{line_of(sts_file, 'readinessProbe:', container_line)}"))

    if "coordinator" not in roles or "daemon" not in roles:
        raise KitError(f"{rel(kit, directory)}: want a coordinator and daemons, found {sorted(roles)}")
    cpod, ccontainer, cvalues, cmachine, _ = roles["coordinator"][0]
    # `kubectl port-forward svc/hybrid-paramd-coordinator 7070`: the
    # Service's port -> its targetPort -> that containerPort of the pod.
    forwards = [words for _, words in readme_commands(kit, "Kubernetes", "kubectl")
                if words[1:2] == ["port-forward"]]
    if not forwards:
        raise KitError("deploy/README.md: no `kubectl port-forward` in the Kubernetes section")
    svc_name = forwards[0][2].split("/", 1)[1]
    svc_port = int(forwards[0][3].split(":")[-1])
    svc = services.get(svc_name)
    if svc is None:
        raise KitError(f"deploy/README.md: kubectl port-forward names Service {svc_name}, which the manifests lack")
    target = next((p.get("targetPort", p["port"]) for p in svc["spec"]["ports"] if p["port"] == svc_port), None)
    container_ports = {p.get("name"): p["containerPort"] for p in ccontainer.get("ports", [])}
    port = container_ports.get(target, target) if isinstance(target, str) else target
    if not isinstance(port, int):
        raise KitError(f"{rel(kit, svc['_file'])}: Service {svc_name} port {svc_port} -> targetPort {target}, "
                       "no containerPort of the coordinator")
    address = f"{cpod['ip']}:{port}"
    # The README's hpctl line: the model at a path every daemon sees, the
    # connection flags.
    loads = [(n, w) for n, w in readme_commands(kit, "Kubernetes", "hpctl") if w[1:2] == ["load"]]
    if not loads:
        raise KitError("deploy/README.md: no `hpctl load` in the Kubernetes section")
    load_line, load_words = loads[0]
    connection = hpctl_connection(load_words, {"127.0.0.1": cpod["ip"], "localhost": cpod["ip"]})
    connection = [a for a in connection if not a.startswith("--address=")] + [f"--address={address}"]
    os.symlink(setup.certs, os.path.join(root, "certs"))
    model_path = load_words[2]
    dmachine = roles["daemon"][0][3]
    try:
        local_model = dmachine.paths(model_path)
    except KitError as e:
        raise KitError(f"deploy/README.md:{load_line}: the model {model_path} is not on a volume the "
                       f"daemons mount ({e})")
    os.makedirs(os.path.dirname(local_model), exist_ok=True)
    os.symlink(setup.model, local_model)
    checkpoint_dir = cvalues.get("checkpoint_dir")  # substituted: the PVC's directory

    check_ports_free(procs, label)
    for p in procs:
        p.start()
    try:
        hpctl = Hpctl(setup.tools["hpctl"], connection, root, procs, label)
        tls_ca = next((a.split("=", 1)[1] for a in connection if a.startswith("--tls_ca=")), None)
        if tls_ca and not os.path.isabs(tls_ca):
            tls_ca = os.path.join(root, tls_ca)

        seen = {}

        def formed():  # each pod's tcpSocket livenessProbe accepts; every daemon joined
            for pod, c, values, machine, proc in [r for rs in roles.values() for r in rs]:
                probe = c.get("livenessProbe", {}).get("tcpSocket")
                if probe:
                    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                    port = ports.get(probe["port"], probe["port"])
                    try:
                        socket.create_connection((pod["ip"], port), timeout=2).close()
                    except OSError as e:
                        sts_file = pod["sts"]["_file"]
                        seen["why"] = (
                            f"{pod['name']}'s livenessProbe (tcpSocket {probe['port']} = {pod['ip']}:{port}, "
                            f"{rel(kit, sts_file)}:{line_of(sts_file, 'livenessProbe:', container_start(c))}) "
                            f"is refused ({e.strerror}), so Kubernetes restarts the pod; the container listens "
                            f"at {flag_origins(proc, 'listen')}")
                        return False
            seen["why"] = "the coordinator's service paramd.rpc.Coordinator is not SERVING"
            return health(setup.tools, address, tls_ca, "paramd.rpc.Coordinator")

        def ready():  # every pod's readinessProbe, as the kubelet runs it
            for name, command, where in probes:
                def probe(command=command):
                    return subprocess.run(command, capture_output=True).returncode == 0
                wait_for(probe, 30, procs, f"{label}: {where}: the readinessProbe of {name} ({' '.join(command)})")

        exercise(label, setup.tools, procs, hpctl, address, tls_ca, len(roles["daemon"]), setup.model,
                 load_path=local_model, checkpoint_dir=checkpoint_dir,
                 ready=ready, formed=formed, explain=lambda: seen.get("why"), start_timeout=start_timeout)
        stop(procs, label)
    finally:
        settle(procs)


# ---------------------------------------------------------------- docker


def docker(kit, setup, label="docker", start_timeout=START_TIMEOUT, net=None):
    """The image's ENTRYPOINT with the arguments of each `docker run` line
    of the README's Container section (its bind mounts in a directory
    standing for $PWD), hpctl with the connection flags of the README's
    hpctl line after it."""
    image = dockerfile_image(kit)
    entrypoint, entry_line = image["ENTRYPOINT"]
    if os.path.basename(entrypoint[0]) != "hybrid-paramd":
        raise KitError(f"{image['file']}:{entry_line}: ENTRYPOINT runs {entrypoint[0]}")
    # The image's default command (CMD) must work too.
    cmd, cmd_line = image.get("CMD", ([], 0))
    r = subprocess.run([setup.tools["binary"], *entrypoint[1:], *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise KitError(f"{image['file']}:{cmd_line}: CMD {cmd} exits {r.returncode}: {r.stderr[-500:]}")
    runs = readme_commands(kit, "Container", "docker run")
    hpctls = readme_commands(kit, "Container", "hpctl")
    count = 0
    for line, words in runs:
        parsed = cd.docker_run(words)
        if parsed is None:
            continue
        count += 1
        options, args = parsed
        where = f"deploy/README.md:{line}"
        pwd = tempfile.mkdtemp(prefix=f"docker{count}-", dir=setup.tmp)
        # The README's preparation: the model in models/, certificates and
        # tokens in certs/ ("Certificates and tokens").
        os.makedirs(os.path.join(pwd, "models"))
        os.symlink(setup.model, os.path.join(pwd, "models", "demo.safetensors"))
        shutil.copytree(setup.certs, os.path.join(pwd, "certs"))
        volumes = cd.docker_volumes(options, pwd)
        published = {}
        for spec in options.get("-p", []) + options.get("--publish", []):
            parts = spec.split(":")
            # Published on every interface of the host: here on 127.0.0.1.
            host_ip = parts[0] if len(parts) == 3 else "127.0.0.1"
            published[int(parts[-1])] = (host_ip, int(parts[-2]))

        def paths(path, volumes=volumes, where=where):
            mapped = cd.in_volumes(path, volumes)
            if mapped == path:
                raise KitError(f"{where}: {path} is in no volume the container mounts (-v)")
            return mapped

        # A listen on the container's port: here on the published host
        # address and port (docker's -p), which must exist.
        machine = Machine({}, paths)
        argv, origins = [setup.tools["binary"], *entrypoint[1:]], []
        for a in args:
            parsed_flag = cd.parse_flag(a)
            new = machine.arg(a)
            if parsed_flag and parsed_flag[0] == "listen":
                host, port = cd.host_port(parsed_flag[1])
                if port not in published:
                    raise KitError(f"{where}: --listen port {port} is not published (-p ...:{port}); "
                                   f"published: {sorted(published)}")
                new = "--listen={}:{}".format(*published[port])
            argv.append(new)
            origins.append((new, where, a))
        follow = [(n, w) for n, w in hpctls if n > line]
        if not follow:
            raise KitError(f"{where}: no hpctl line follows this docker run")
        hline, hwords = follow[0]
        # HOST (the docker host's name) -> 127.0.0.1.
        connection = hpctl_connection(hwords, {"HOST": "127.0.0.1"})
        address = next((a.split("=", 1)[1] for a in connection if a.startswith("--address=")), "127.0.0.1:7070")
        tls_ca = next((os.path.join(pwd, a.split("=", 1)[1]) for a in connection if a.startswith("--tls_ca=")), None)
        values = dict(cd.parse_flag(a) for a in argv[1:] if cd.parse_flag(a))
        checkpoint_dir = values.get("checkpoint_dir")
        proc = Proc(f"docker{count}", argv, origins, pwd, None, pwd)
        procs = [proc]
        check_ports_free(procs, f"{label} {where}")
        proc.start()
        try:
            hpctl = Hpctl(setup.tools["hpctl"], connection, pwd, procs, f"{label} {where} (hpctl: deploy/README.md:{hline})")
            model = values.get("model")
            exercise(f"{label} {where}", setup.tools, procs, hpctl, address, tls_ca,
                     1 if values.get("role", "both") == "both" else int(values.get("daemons", 1)),
                     setup.model, load_path=None if model else setup.model, checkpoint_dir=checkpoint_dir,
                     start_timeout=start_timeout)
            stop(procs, f"{label} {where}")
        finally:
            settle(procs)
    if count == 0:
        raise KitError("deploy/README.md: no `docker run ... hybrid-paramd` line in the Container section")


# ---------------------------------------------------------------- Slurm

SLURM_NODES = ["node1", "node2"]


def slurm(kit, setup, label="slurm", start_timeout=START_TIMEOUT, net=None):
    """deploy/slurm/hybrid-paramd.sbatch as sbatch runs it on the first node
    of a 2-node allocation with one GPU per node, the README's settings
    (PARAMD_BIN, PARAMD_MODEL, PARAMD_RECIPE, PARAMD_CHECKPOINT_DIR under
    /shared) plus TLS and tokens (PARAMD_TLS_*, PARAMD_TOKEN_FILE); srun and
    scontrol are this file's fakes; the trainer step is this file waiting
    until hpctl has driven the cluster."""
    script = os.path.join(kit, "deploy", "slurm", "hybrid-paramd.sbatch")
    script_rel = rel(kit, script)
    root = tempfile.mkdtemp(prefix="slurm-", dir=setup.tmp)
    shared = os.path.join(root, "shared")  # /shared of the README: one file system
    os.makedirs(os.path.join(shared, "bin"))
    os.symlink(setup.tools["binary"], os.path.join(shared, "bin", "hybrid-paramd"))
    # The launcher asks health itself, on the first node, by the node's
    # name: a wrapper resolves the node names (see SUBSTITUTIONS).
    write_fake(os.path.join(shared, "bin", "hybrid-paramd-health"), "--fake-resolve", setup.tools["health"])
    os.symlink(setup.model, os.path.join(shared, "model.safetensors"))
    shutil.copyfile(os.path.join(kit, "deploy", "recipes", "demo.textproto"),
                    os.path.join(shared, "recipe.textproto"))
    shutil.copytree(setup.certs, os.path.join(shared, "certs"))
    state = os.path.join(root, "state")
    os.makedirs(os.path.join(state, "steps"))
    fake_bin = os.path.join(root, "bin")
    os.makedirs(fake_bin)
    for tool in ("srun", "scontrol"):
        write_fake(os.path.join(fake_bin, tool), f"--fake-{tool}")
    hosts = {n: f"127.20.0.{i}" for i, n in enumerate(SLURM_NODES, 1)}
    env = {
        # What sbatch --nodes=2 --gpus-per-node=1 gives the batch script.
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "SLURMD_NODENAME": SLURM_NODES[0],
        "PATH": fake_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        # The README's settings, /shared below the temporary root.
        "PARAMD_BIN": os.path.join(shared, "bin", "hybrid-paramd"),
        "PARAMD_MODEL": os.path.join(shared, "model.safetensors"),
        "PARAMD_RECIPE": os.path.join(shared, "recipe.textproto"),
        "PARAMD_CHECKPOINT_DIR": os.path.join(shared, "ckpt"),
        "PARAMD_TLS_CERT": os.path.join(shared, "certs", "server.pem"),
        "PARAMD_TLS_KEY": os.path.join(shared, "certs", "server.key"),
        "PARAMD_TLS_CA": os.path.join(shared, "certs", "ca.pem"),
        "PARAMD_TOKEN_FILE": os.path.join(shared, "certs", "tokens"),
        # For the fakes.
        "KIT_TEST_SLURM_STATE": state,
        "KIT_TEST_SLURM_HOSTS": ",".join(f"{n}={ip}" for n, ip in hosts.items()),
    }
    logdir = os.path.join(root, "log")
    os.makedirs(logdir)
    script_text = open(script).read()
    job = Proc("sbatch", ["bash", os.path.abspath(script), "--", sys.executable, os.path.abspath(__file__),
                          "--fake-trainer"], [("sbatch", f"{script_rel}:1", "")], logdir, env, root)
    for setting in ("PARAMD_PORT", "PARAMD_DAEMON_PORT"):
        default = re.search(rf"\$\{{{setting}:-(\d+)\}}", script_text)
        for ip in hosts.values():
            if default and not port_free(ip, int(default.group(1))):
                raise KitError(f"{label}: {ip}:{default.group(1)} ({setting}'s default) is in use by another "
                               "process on this machine, not by this test: run the test alone")
    job.start()
    steps = []

    def step_procs():
        """The launcher's steps as processes (for logs and diagnosis), as
        the fake srun recorded them."""
        for name in sorted(os.listdir(os.path.join(state, "steps"))):
            if name.endswith(".argv") and name[: -len(".argv")] not in [p.name for p in steps]:
                argv = json.load(open(os.path.join(state, "steps", name)))
                steps.append(Step(name[: -len(".argv")], argv, script, script_rel, os.path.join(state, "steps")))
        return steps

    try:
        # PARAMD_TRAINERS_PER_NODE defaults to the GPUs per node.
        trainers = len(SLURM_NODES) * int(env["SLURM_GPUS_ON_NODE"])

        def trainers_started():
            step_procs()
            if job.poll() is not None:
                raise KitError(f"{label}: {script_rel} exited {job.rc} before its trainers started:\n"
                               f"  {job.text()[-1500:]}\n{diagnose(steps)}")
            return len([f for f in os.listdir(state) if f.startswith("trainer-")]) >= trainers

        deadline = time.time() + start_timeout
        while not trainers_started():
            if time.time() > deadline:
                raise KitError(f"{label}: the launcher did not start its trainers within {start_timeout} s:\n"
                               f"  {job.text()[-1500:]}\n{diagnose(step_procs())}")
            for p in steps:
                if p.poll() is not None:
                    raise KitError(f"{label}: step {p.name} exited {p.rc} before the trainers started\n"
                                   f"{diagnose(steps)}")
            time.sleep(0.2)
        records = [json.load(open(os.path.join(state, f))) for f in sorted(os.listdir(state))
                   if f.startswith("trainer-")]
        address = records[0]["PARAMD_COORDINATOR"]
        if sorted(r["SLURM_PROCID"] for r in records) != [str(i) for i in range(trainers)] or any(
                r["PARAMD_COORDINATOR"] != address for r in records):
            raise KitError(f"{label}: the trainers saw {records}")
        procs = [job] + step_procs()
        hpctl = Hpctl(setup.tools["hpctl"], [f"--address={address}", f"--tls_ca={env['PARAMD_TLS_CA']}",
                                             f"--auth_token_file={env['PARAMD_TOKEN_FILE']}"], root, procs, label)
        daemons = [p for p in steps if "--role=daemon" in p.argv]
        exercise(label, setup.tools, procs, hpctl, address, env["PARAMD_TLS_CA"], len(daemons), setup.model,
                 load_path=None, checkpoint_dir=env["PARAMD_CHECKPOINT_DIR"], start_timeout=start_timeout)
        # The trainers finish: the launcher stops the daemons and the
        # coordinator (SIGTERM) and exits with the trainers' status.
        with open(os.path.join(state, "release"), "w") as f:
            f.write("0")
        try:
            job.rc = job.popen.wait(timeout=STOP_TIMEOUT + 10)
        except subprocess.TimeoutExpired:
            raise KitError(f"{label}: {script_rel} did not exit after its trainers finished\n{diagnose(steps)}")
        if job.rc != 0:
            raise KitError(f"{label}: {script_rel} exited {job.rc}:\n  {job.text()[-1500:]}\n{diagnose(steps)}")
        for p in step_procs():
            if p.poll() != 0:
                raise KitError(f"{label}: step {p.name} exited {p.rc} when the launcher stopped it (SIGTERM), "
                               f"want 0\n{diagnose(steps)}")
        names = sorted(p.name for p in steps)
        say(f"{label}: {script_rel} exited 0; steps {', '.join(names)} all exited 0")
    finally:
        settle([job] + steps)


class Step(Proc):
    """A step the launcher ran through the fake srun: its argv, output and
    exit code as srun recorded them; each flag's origin is the launcher's
    line with --FLAG nearest to the line with the step's --role."""

    def __init__(self, name, argv, script, script_rel, directory):
        lines = open(script).read().split("\n")
        code = [(n, l) for n, l in enumerate(lines, 1) if not l.lstrip().startswith("#")]
        role = next((a for a in argv if a.startswith("--role=")), None)
        role_line = next((n for n, l in code if role and role in l), 0)
        origins = []
        for a in argv:
            parsed = cd.parse_flag(a)
            if parsed:
                found = [n for n, l in code if f"--{parsed[0]}" in l]
                n = min(found, key=lambda n: abs(n - role_line)) if found else 0
                origins.append((a, f"{script_rel}:{n}", lines[n - 1].strip() if n else ""))
        super().__init__(name, argv, origins, directory)
        self.rc_file = os.path.join(directory, name + ".rc")

    def poll(self):
        if self.rc is None and os.path.exists(self.rc_file):
            text = open(self.rc_file).read()
            self.rc = int(text) if text else None
        return self.rc


def write_fake(path, *mode):
    """An executable that runs this file in `mode`."""
    words = " ".join(shlex.quote(w) for w in (sys.executable, os.path.abspath(__file__), *mode))
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {words} \"$@\"\n")
    os.chmod(path, 0o755)


def fake_resolve(argv):
    """BINARY ARGS...: runs BINARY with the node names of its arguments
    replaced by the nodes' addresses."""
    hosts = dict(kv.split("=") for kv in os.environ["KIT_TEST_SLURM_HOSTS"].split(","))
    machine = Machine(hosts, lambda p: p)
    os.execv(argv[0], [argv[0]] + [machine.arg(a) for a in argv[1:]])


def fake_scontrol(argv):
    """`scontrol show hostnames LIST` for LIST like node[1-2] or a,b."""
    if argv[:2] != ["show", "hostnames"]:
        sys.exit(f"fake scontrol: only 'show hostnames', not {argv}")
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", argv[2]):
        m = re.match(r"^(.*)\[(.*)\]$", part)
        if not m:
            print(part)
            continue
        for r in m.group(2).split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                print(f"{m.group(1)}{str(i).zfill(len(lo))}")


def fake_srun(argv):
    """srun [options] COMMAND...: runs the step's tasks here, each on its
    node's address (host names and fixed-port wildcard listens in the
    arguments and the environment substituted), writes the step's argv,
    output and exit code under KIT_TEST_SLURM_STATE/steps, forwards
    SIGTERM and exits with the highest task exit code."""
    state = os.environ["KIT_TEST_SLURM_STATE"]
    hosts = dict(kv.split("=") for kv in os.environ["KIT_TEST_SLURM_HOSTS"].split(","))
    nodes = list(hosts)
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in ("-w", "--nodelist", "-J", "-N", "-n") and not eq:
            i += 1
            value = argv[i]
        elif name not in ("--overlap", "--nodes", "--ntasks", "--job-name", "--ntasks-per-node",
                          "--export", "-w", "--nodelist", "-J", "-N", "-n"):
            sys.exit(f"fake srun: option {argv[i]} is not emulated")
        opts[name] = value
        i += 1
    command = argv[i:]
    where = opts.get("-w") or opts.get("--nodelist")
    step_nodes = [where] if where else nodes[: int(opts.get("--nodes", opts.get("-N", len(nodes))))]
    per_node = int(opts.get("--ntasks-per-node", 1))
    name = opts.get("--job-name", opts.get("-J", "trainers"))
    tasks = []
    for n, node in enumerate(step_nodes):
        machine = Machine(hosts, lambda p: p, hosts[node])
        for local in range(per_node):
            rank = n * per_node + local
            env = {k: machine.value(v) if k == "PARAMD_COORDINATOR" else v for k, v in os.environ.items()}
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(len(step_nodes) * per_node),
                       SLURM_NODEID=str(nodes.index(node)), SLURM_LOCALID=str(local), SLURMD_NODENAME=node)
            tasks.append(([command[0]] + [machine.arg(a) for a in command[1:]], env))
    base = os.path.join(state, "steps", name)
    with open(base + ".argv", "w") as f:
        json.dump(tasks[0][0], f)
    with open(base + ".log", "w") as log:
        children = [subprocess.Popen(t, env=e, stdout=log, stderr=subprocess.STDOUT) for t, e in tasks]

    def forward(signum, _frame):
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = max(c.wait() for c in children)
    with open(base + ".rc", "w") as f:
        f.write(str(rc))
    sys.exit(rc)


def fake_trainer():
    """A trainer task: records what the launcher gave it, then waits until
    the test has driven the cluster (the file `release`: its exit code)."""
    state = os.environ["KIT_TEST_SLURM_STATE"]
    record = {k: os.environ.get(k) for k in ("PARAMD_COORDINATOR", "SLURM_PROCID", "SLURM_NTASKS")}
    with open(os.path.join(state, f".trainer-{record['SLURM_PROCID']}"), "w") as f:
        json.dump(record, f)
    os.rename(os.path.join(state, f".trainer-{record['SLURM_PROCID']}"),
              os.path.join(state, f"trainer-{record['SLURM_PROCID']}"))
    release = os.path.join(state, "release")
    deadline = time.time() + 600
    while not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.2)
    sys.exit(int(open(release).read()) if os.path.exists(release) else 1)


# ---------------------------------------------------------------- mutants


def mutant(setup, deployment, title, file, old, new, want, net):
    """A copy of the kit with `old` replaced by `new` in `file` must fail,
    the message containing `want` (a FILE:LINE; None: the line changed).
    Returns a failure or None."""
    kit = tempfile.mkdtemp(prefix="mutant-", dir=setup.tmp)
    for d in ("deploy/systemd", "deploy/k8s", "deploy/docker", "deploy/slurm", "deploy/recipes"):
        shutil.copytree(d, os.path.join(kit, d))
    shutil.copyfile("deploy/README.md", os.path.join(kit, "deploy", "README.md"))
    path = os.path.join(kit, file)
    text = open(path).read()
    if old not in text:
        return f"mutant '{title}': {file} has no {old!r} to change"
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))
    if want is None:  # the line changed (the last line of `new`)
        want = f"{file}:{text[:text.index(old)].count(chr(10)) + 1 + new.count(chr(10))}"
    start = time.time()
    OUT.quiet = True  # a failure is what a mutant should do: no logs
    try:
        DEPLOYMENTS[deployment](kit, setup, label=f"mutant {deployment}", start_timeout=MUTANT_START_TIMEOUT,
                                net=net)
    except KitError as e:
        if want in str(e).split("\n---- log")[0]:
            say(f"ok: mutant '{title}' fails in {time.time() - start:.1f} s naming {want}:")
            lines = str(e).split("\n")
            say("\n".join("  " + l.strip() for l in lines[:1] + [l for l in lines[1:] if want in l][:1]))
            return None
        return f"mutant '{title}': the failure does not name {want}:\n{e}"
    finally:
        OUT.quiet = False
    return f"mutant '{title}': the deployment still works"


# (deployment, title, file, old, new, the FILE:LINE the failure must name
# (None: the changed line), the addresses it uses: not those of the
# shipped run, which may overlap).
MUTANTS = [
    ("systemd", "a daemon dials the coordinator on another port", "deploy/systemd/daemon0.flags",
     "--coordinator=coordinator.example:7070", "--coordinator=coordinator.example:7075", None, "127.31.0"),
    ("systemd", "the README enables one daemon of the two the coordinator expects", "deploy/README.md",
     "hybrid-paramd@daemon0 hybrid-paramd@daemon1", "hybrid-paramd@daemon0",
     "deploy/systemd/coordinator.flags:5", "127.31.0"),
    ("k8s", "the daemons listen on another port than the pods' grpc port", "deploy/k8s/configmap.yaml",
     "--role=daemon\n    --listen=0.0.0.0:7070", "--role=daemon\n    --listen=0.0.0.0:7071", None, "127.78"),
    ("slurm", "the daemons advertise another port than they listen on", "deploy/slurm/hybrid-paramd.sbatch",
     '"--advertise_address=$node:$p"', '"--advertise_address=$node:$((p + 1))"', None, None),
    ("docker", "a docker run line publishes another container port than --listen", "deploy/README.md",
     "-p 127.0.0.1:7070:7070", "-p 127.0.0.1:7070:7071", None, None),
]


# ---------------------------------------------------------------- main


DEPLOYMENTS = {"systemd": systemd, "k8s": k8s, "docker": docker, "slurm": slurm}
# Two lanes, run side by side (their addresses differ; the docker lines,
# both on 127.0.0.1:7070, one after the other): the clusters spend much of
# their time waiting, and CI has 2 cores.
LANES = [["systemd", "k8s", "slurm", "mutant slurm", "mutant k8s"], ["docker", "mutant docker", "mutant systemd"]]


def main(argv):
    if "--fake-srun" in argv[1:2]:
        return fake_srun(argv[2:])
    if "--fake-scontrol" in argv[1:2]:
        return fake_scontrol(argv[2:])
    if "--fake-resolve" in argv[1:2]:
        return fake_resolve(argv[2:])
    if "--fake-trainer" in argv[1:]:
        return fake_trainer()
    options = [a for a in argv[1:] if a.startswith("--")]
    positional = [a for a in argv[1:] if not a.startswith("--")]
    if len(positional) != 4:
        sys.exit(__doc__)
    tools = dict(zip(("binary", "hpctl", "health", "make_certs"), map(os.path.abspath, positional)))
    only = next((a.split("=", 1)[1].split(",") for a in options if a.startswith("--only=")), list(DEPLOYMENTS))
    atexit.register(kill_all)

    def terminated(*_):  # Bazel's timeout: nothing may outlive the test
        kill_all()
        os._exit(143)

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGINT, terminated)
    tmp = tempfile.mkdtemp(prefix="kit_test.", dir=os.environ.get("TEST_TMPDIR"))
    if "--keep" not in options:
        atexit.register(shutil.rmtree, tmp, True)
    start = time.time()
    preset = next((a.split("=", 1)[1] for a in options if a.startswith("--preset=")), PRESET)
    setup = Setup(tools, tmp, preset)
    failures, lock = [], threading.Lock()

    def run_lane(items):
        for item in items:
            OUT.lines = []
            t = time.time()
            try:
                if item.startswith("mutant "):
                    if "--no-mutants" in options or item.split()[1] not in only:
                        continue
                    for m in MUTANTS:
                        if m[0] == item.split()[1]:
                            failure = mutant(setup, *m)
                            if failure:
                                failures.append(f"FAIL {failure}")
                                say(failures[-1])
                elif item in only:
                    DEPLOYMENTS[item](".", setup)
                    say(f"PASS {item} ({time.time() - t:.1f} s)")
            except KitError as e:
                failures.append(f"FAIL {item}: {e}")
                say(failures[-1])
            except Exception as e:  # a bug here: fail, with the trace
                import traceback
                failures.append(f"FAIL {item}: {e!r}")
                say(traceback.format_exc())
            finally:
                if OUT.lines:
                    with lock:
                        print("\n".join(OUT.lines), flush=True)

    lanes = [threading.Thread(target=run_lane, args=(lane,), daemon=True) for lane in LANES]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    summary = "\n".join(f.split("\n")[0] for f in failures)
    print(f"{len(failures)} failure(s) in {time.time() - start:.1f} s:\n{summary}" if failures
          else f"every deployment works as shipped ({time.time() - start:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
