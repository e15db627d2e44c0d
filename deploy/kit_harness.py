#!/usr/bin/env python3
"""The harness of //deploy:kit_test (kit_test.py says what the test does):
processes started from a shipped file's command line, with each flag's file
and line (Proc, diagnose); machines as loopback addresses (Machine); hpctl
and the health probe; the exercise every deployment runs (load, step, fetch,
checkpoint, export); the substitutions between a shipped file and what runs
(SUBSTITUTIONS below)."""

import json
import os
import re
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
#  * Slurm: srun and scontrol are fakes (kit_slurm.py) that run each step as a
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


def settle(procs):
    """Kills what is left of `procs` (after a failure), logs printed."""
    if any(p.poll() is None for p in procs) or any(p.rc not in (0, None) for p in procs):
        print_logs(procs)
    kill(procs)
