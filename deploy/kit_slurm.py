#!/usr/bin/env python3
"""//deploy:kit_test's Slurm deployment: deploy/slurm/hybrid-paramd.sbatch run
as sbatch would, with fakes of srun and scontrol (this file, run as
`kit_slurm.py --fake-srun|--fake-scontrol|--fake-resolve ARGS...`) that run
each step as a local process, and the trainer step (`--fake-trainer`) that
waits until the test has driven the cluster."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_deploy as cd  # noqa: E402  (the static checks' parsers)
from kit_harness import (  # noqa: E402
    Hpctl,
    KitError,
    Machine,
    Proc,
    START_TIMEOUT,
    STOP_TIMEOUT,
    diagnose,
    exercise,
    port_free,
    rel,
    say,
    settle,
)


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


# ---------------------------------------------------------------- Slurm

SLURM_NODES = ["node1", "node2"]


def main(argv):
    if argv[1:2] == ["--fake-srun"]:
        return fake_srun(argv[2:])
    if argv[1:2] == ["--fake-scontrol"]:
        return fake_scontrol(argv[2:])
    if argv[1:2] == ["--fake-resolve"]:
        return fake_resolve(argv[2:])
    if "--fake-trainer" in argv[1:]:
        return fake_trainer()
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
