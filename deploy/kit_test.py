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
the process are the mechanical ones kit_harness.py lists (SUBSTITUTIONS), each a thing a
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
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_deploy as cd  # noqa: E402  (the static checks' parsers)
from kit_harness import (  # noqa: E402
    Hpctl,
    KitError,
    MUTANT_START_TIMEOUT,
    Machine,
    NAMESPACE,
    OUT,
    PRESET,
    Proc,
    START_TIMEOUT,
    Setup,
    check_ports_free,
    exercise,
    flag_origins,
    health,
    hpctl_connection,
    install_flagfile,
    kill_all,
    line_of,
    private_copy,
    readme_commands,
    rel,
    say,
    settle,
    stop,
    wait_for,
)
from kit_slurm import slurm  # noqa: E402


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
