#!/usr/bin/env python3
"""Static checks of the deploy kit (deploy/systemd, deploy/k8s, deploy/slurm,
deploy/docker), run by the //deploy:*_check tests.

Every flag a file passes to hybrid-paramd must be one that
`hybrid-paramd --helpfull` lists, so a renamed flag fails CI instead of a
deployment. Usage:

  check_deploy.py systemd HYBRID_PARAMD DIR
  check_deploy.py k8s HYBRID_PARAMD HPCTL HEALTH DIR
  check_deploy.py slurm HYBRID_PARAMD SCRIPT HEALTH
  check_deploy.py docker HYBRID_PARAMD DOCKERFILE INSTALL_DEPS README HEALTH HPCTL MAKE_CERTS

Prints one line per problem and exits 1 if there is any.
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

PROBLEMS = []


def problem(where, message):
    PROBLEMS.append(f"{where}: {message}")


def known_flags(binary, expect=("role", "coordinator")):
    """The flags `binary --helpfull` lists (it must list those of `expect`)."""
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stdout
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+) ", out, re.M))
    if not set(expect) <= flags:
        sys.exit(f"could not read the flags of {binary} --helpfull:\n{out[:2000]}")
    return flags


def parse_flag(arg):
    """'--name=value' -> (name, value); '--name' -> (name, None); else None."""
    m = re.match(r"^--([A-Za-z0-9_]+)(?:=(.*))?$", arg)
    return (m.group(1), m.group(2)) if m else None


def flagfile_args(text, where):
    """The flags of an absl flagfile: one per line, '#' comments."""
    args = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if parse_flag(line) is None:
            problem(f"{where}:{n}", f"not a flag: {line!r}")
            continue
        args.append(line)
    return args


def check_flags(args, flags, where):
    values = {}
    for a in args:
        parsed = parse_flag(a)
        if parsed is None:
            continue
        name, value = parsed
        if name.startswith("no") and name[2:] in flags:
            name = name[2:]
        if name not in flags:
            problem(where, f"hybrid-paramd has no flag --{name}")
        values[name] = value
    return values


def check_role(values, where):
    role = values.get("role", "both")
    if role not in ("coordinator", "daemon", "both"):
        problem(where, f"--role={role} is not coordinator, daemon or both")
    if role == "daemon" and "coordinator" not in values:
        problem(where, "a daemon without --coordinator connects to 127.0.0.1:7070")
    return role


# The optimizer config is the coordinator's (recipe `optimizer` section,
# --optimizer=FILE or these flags there); daemons take it at join.
OPTIMIZER_FLAGS = ("optimizer", "lr", "beta1", "beta2", "adam_eps", "weight_decay", "momentum")


def check_no_daemon_optimizer(values, role, where):
    if role != "daemon":
        return
    given = [f"--{f}" for f in OPTIMIZER_FLAGS if f in values]
    if given:
        problem(where, f"daemon optimizer flags {' '.join(given)}: the coordinator owns the optimizer "
                "config (daemons take it at join); give them to the coordinator")


# Flags naming files of secrets (Kubernetes: from a Secret; systemd: credentials).
SECRET_FLAGS = ("tls_cert", "tls_key", "tls_ca", "auth_token_file", "cluster_secret_file")


def is_loopback(listen):
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    host = host.strip("[]")
    return host in ("localhost", "::1") or re.match(r"^127\.\d+\.\d+\.\d+$", host) is not None


def check_listen(values, where):
    """hybrid-paramd's start-up rule (docs/SECURITY.md, "Listening"): without
    TLS the gRPC ports are loopback only, and the metrics endpoint (plain
    HTTP, TLS or not) too, unless --insecure_listen_anywhere."""
    insecure = values.get("insecure_listen_anywhere", "") in (None, "true", "1")
    tls = bool(values.get("tls_cert"))
    for flag, default in (("listen", "127.0.0.1:7070"), ("data_plane_listen", "127.0.0.1:0"),
                          ("device_channel_listen", "127.0.0.1:0")):
        value = values.get(flag) or default
        if not (tls or insecure or is_loopback(value)):
            problem(where, f"--{flag}={value} without TLS or --insecure_listen_anywhere: refused at start")
    metrics = values.get("metrics_listen") or (
        f"0.0.0.0:{values['metrics_port']}" if values.get("metrics_port") not in (None, "", "0") else "")
    if metrics and not insecure and not is_loopback(metrics):
        problem(where, f"metrics on {metrics} (plain HTTP) without --insecure_listen_anywhere: "
                "refused at start")


def host_port(value):
    m = re.match(r"^(.*):(\d+)$", value or "")
    return (m.group(1), int(m.group(2))) if m else (None, None)


# ---------------------------------------------------------------- systemd


def check_secured(values, where, network):
    """Servers on a network: TLS and tokens."""
    if not values.get("tls_cert"):
        problem(where, f"gRPC on {network} without TLS (--tls_cert/--tls_key)")
    if not values.get("auth_token_file"):
        problem(where, f"no --auth_token_file: anyone on {network} may call every RPC")


def unit_directives(text):
    """The KEY=VALUE lines of a systemd unit as (key, value, line number),
    backslash continuations joined (the number is the first line's);
    comments and section headers skipped."""
    directives = []
    lines = text.split("\n")
    n = 0
    while n < len(lines):
        start, line = n + 1, lines[n]
        while line.endswith("\\") and n + 1 < len(lines):
            n += 1
            line = line[:-1] + " " + lines[n].strip()
        n += 1
        stripped = line.strip()
        if not stripped or stripped[0] in "#;[" or "=" not in stripped:
            continue
        key, _, value = stripped.partition("=")
        directives.append((key.strip(), value.strip(), start))
    return directives


def unit_credentials(directives):
    """LoadCredential=NAME:PATH directives: NAME -> PATH."""
    return dict(v.split(":", 1) for k, v, _ in directives
                if k in ("LoadCredential", "LoadCredentialEncrypted") and ":" in v)


def check_systemd(binary, directory):
    flags = known_flags(binary)
    unit_path = os.path.join(directory, "hybrid-paramd@.service")
    unit = open(unit_path).read()
    directives = unit_directives(unit)
    exec_start = [v for k, v, _ in directives if k == "ExecStart"]
    if not exec_start:
        problem(unit_path, "no ExecStart")
        return
    words = shlex.split(exec_start[0])
    exec_binary, exec_args = words[0], words[1:]
    dynamic_user = any(k == "DynamicUser" and v in ("yes", "true", "on", "1") for k, v, _ in directives)
    credentials = unit_credentials(directives)
    instances = sorted(f[: -len(".flags")] for f in os.listdir(directory) if f.endswith(".flags"))
    if not instances:
        problem(directory, "no example .flags files")
    with tempfile.TemporaryDirectory() as tmp:
        for instance in instances:
            where = os.path.join(directory, instance + ".flags")
            file_args = flagfile_args(open(where).read(), where)
            # The command line: the flagfile (this instance's file), then the
            # unit's own flags, which override it.
            args = []
            for a in exec_args:
                parsed = parse_flag(a.replace("%i", instance))
                if parsed and parsed[0] == "flagfile":
                    if os.path.basename(parsed[1]) != instance + ".flags":
                        problem(unit_path, f"--flagfile={parsed[1]} is not the instance's .flags file")
                    args += file_args
                else:
                    args.append(a.replace("%i", instance))
            values = check_flags(args, flags, f"{unit_path} + {where}")
            role = check_role(values, where)
            check_listen(values, where)
            check_no_daemon_optimizer(values, role, where)
            check_secured(values, where, "the network")
            # Secret files: the dynamic user owns no file on the host, so
            # they come as credentials (%d = $CREDENTIALS_DIRECTORY).
            file_values = check_flags(file_args, flags, where)
            for flag in SECRET_FLAGS:
                path = values.get(flag)
                if not path:
                    continue
                if flag in file_values:
                    problem(where, f"--{flag} in a flagfile: give it in the unit as %d/NAME with "
                            "LoadCredential=NAME:PATH")
                elif not path.startswith("%d/"):
                    if dynamic_user:
                        problem(unit_path, f"--{flag}={path}: a DynamicUser cannot read a root-owned "
                                "0600 file; LoadCredential=NAME:PATH and %d/NAME")
                elif path[len("%d/"):] not in credentials:
                    problem(unit_path, f"--{flag}={path}: no LoadCredential={path[len('%d/'):]}:PATH")
            # systemd-analyze verify needs the binary to exist: point
            # ExecStart at the one under test, one file per instance.
            path = os.path.join(tmp, f"hybrid-paramd@{instance}.service")
            with open(path, "w") as f:
                f.write(unit.replace("ExecStart=" + exec_binary, "ExecStart=" + os.path.abspath(binary), 1))
            r = subprocess.run(["systemd-analyze", "verify", path], capture_output=True, text=True)
            # Unknown keys are only warnings there: any output is a problem.
            out = (r.stdout + r.stderr).strip()
            if r.returncode != 0 or out:
                problem(unit_path, f"systemd-analyze verify ({instance}): rc {r.returncode}: {out}")
    print(f"systemd: {unit_path} verified for {', '.join(instances)}")


# ---------------------------------------------------------------- k8s


def load_k8s(directory):
    import yaml  # python3-yaml

    objects = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".yaml"):
            continue
        path = os.path.join(directory, name)
        for doc in yaml.safe_load_all(open(path)):
            if doc is None:
                continue
            for key in ("apiVersion", "kind", "metadata"):
                if key not in doc:
                    problem(path, f"an object without {key}")
            doc["_file"] = path
            objects.append(doc)
    return objects


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def expand(value, env):
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def secret_sources(pod, volumes, where):
    """mountPath -> the Secret names whose files are there, for the secret
    volumes the containers mount and for the emptyDirs an init container
    fills from secret volumes with mode 0600 (a Secret volume's own files are
    readable by group or others, which hybrid-paramd refuses)."""
    def secret_of(v):
        return v.get("secret", {}).get("secretName")

    copied = {}  # emptyDir volume name -> Secret names
    for ic in pod.get("initContainers", []):
        mounts = ic.get("volumeMounts", [])
        for m in mounts:
            if m["name"] not in volumes:
                problem(where, f"init container {ic['name']}: volumeMount {m['name']} is not a volume of the pod")
        names = [secret_of(volumes[m["name"]]) for m in mounts if m["name"] in volumes]
        names = [n for n in names if n]
        targets = [m["name"] for m in mounts
                   if m["name"] in volumes and "emptyDir" in volumes[m["name"]] and not m.get("readOnly")]
        if names and targets:
            command = " ".join(ic.get("command", []) + ic.get("args", []))
            if not re.search(r"(-m\s*0?600\b|chmod\s+0?600\b|-m\s*0?400\b|chmod\s+0?400\b)", command):
                problem(where, f"init container {ic['name']} copies Secrets without making the files 0600")
            for t in targets:
                copied.setdefault(t, set()).update(names)
    return copied


def check_secret_files(values, mounts, copied, where):
    """Every secret file flag names a file under a mount that a Secret fills."""
    for flag in SECRET_FLAGS:
        path = values.get(flag)
        if not path:
            continue
        directory = os.path.dirname(path)
        volume = mounts.get(directory)
        if volume is None:
            problem(where, f"--{flag}={path} is not in a mounted volume")
        elif "secret" in volume:
            problem(where, f"--{flag}={path} is read straight from Secret volume {volume['name']}: its "
                    "files are readable by group or others, which hybrid-paramd refuses; copy them "
                    "0600 into an emptyDir in an init container")
        elif volume["name"] not in copied:
            problem(where, f"--{flag}={path} is in volume {volume['name']}, which no Secret fills")


def check_probes(c, values, listen_port, health, health_flags, where):
    """Readiness is gRPC health (over TLS when the server speaks it: only an
    exec of hybrid-paramd-health can, Kubernetes' gRPC probe is plaintext);
    liveness is not health, or a process waiting for its peers is killed."""
    tls = bool(values.get("tls_cert"))
    readiness = c.get("readinessProbe")
    if not readiness:
        problem(where, "no readinessProbe (gRPC health)")
    elif "grpc" in readiness:
        if tls:
            problem(where, "a gRPC readinessProbe against a TLS server: Kubernetes' gRPC probe speaks no "
                    "TLS; exec hybrid-paramd-health --tls_ca")
        elif readiness["grpc"].get("port") != listen_port:
            problem(where, f"the gRPC readiness probe's port {readiness['grpc'].get('port')} is not --listen's")
    elif "exec" in readiness:
        command = readiness["exec"].get("command", [])
        if not command or os.path.basename(command[0]) != os.path.basename(health):
            problem(where, f"the readiness probe runs {command[:1]}, not {os.path.basename(health)}")
        else:
            probe = check_flags(command[1:], health_flags, f"{where} readinessProbe")
            _, port = host_port(probe.get("address", "127.0.0.1:7070"))
            if port != listen_port:
                problem(where, f"the readiness probe asks port {port}, not --listen's {listen_port}")
            if tls and probe.get("tls_ca") != values.get("tls_ca"):
                problem(where, f"the readiness probe's --tls_ca={probe.get('tls_ca')} is not the "
                        f"server's --tls_ca={values.get('tls_ca')}")
            if not tls and probe.get("tls_ca"):
                problem(where, "the readiness probe speaks TLS to a plaintext server")
            if readiness.get("timeoutSeconds", 1) < 2:
                problem(where, "the readiness probe's timeoutSeconds < 2 (a health call may take 2 s)")
    else:
        problem(where, "the readinessProbe is neither gRPC health nor hybrid-paramd-health")
    liveness = c.get("livenessProbe", {})
    live_command = liveness.get("exec", {}).get("command", [""])
    if "grpc" in liveness or os.path.basename(live_command[0]) == os.path.basename(health):
        problem(where, "the livenessProbe is gRPC health, which is NOT_SERVING while the process waits "
                "for its peers or a model: it would be restarted; probe the port (tcpSocket)")


def check_k8s(binary, hpctl, health, directory):
    flags = known_flags(binary)
    health_flags = known_flags(health, expect=("address", "tls_ca"))
    objects = load_k8s(directory)
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o.get("kind"), {})[o["metadata"].get("name")] = o
    services = by_kind.get("Service", {})
    configmaps = by_kind.get("ConfigMap", {})
    pvcs = by_kind.get("PersistentVolumeClaim", {})
    workloads = {**by_kind.get("StatefulSet", {}), **by_kind.get("Deployment", {})}
    for required in ("ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet"):
        if required not in by_kind:
            problem(directory, f"no {required}")

    roles = {}  # role -> (workload, flag values, Secret names the secret files come from)
    for name, w in workloads.items():
        where = f"{w['_file']}: {w['kind']} {name}"
        spec = w.get("spec", {})
        template = spec.get("template", {})
        labels = template.get("metadata", {}).get("labels", {})
        if not matches(spec.get("selector", {}).get("matchLabels"), labels):
            problem(where, "spec.selector.matchLabels does not select the pod template's labels")
        if w["kind"] == "StatefulSet":
            svc = services.get(spec.get("serviceName"))
            if svc is None:
                problem(where, f"serviceName {spec.get('serviceName')!r} is not a Service here")
            elif not matches(svc["spec"].get("selector"), labels):
                problem(where, f"Service {svc['metadata']['name']} does not select these pods")
        pod = template.get("spec", {})
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                problem(where, f"volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in pvcs:
                problem(where, f"volume {v['name']}: no PVC {v['persistentVolumeClaim']['claimName']}")
        copied = secret_sources(pod, volumes, where)
        for c in pod.get("containers", []):
            cwhere = f"{where} container {c['name']}"
            env = {e["name"]: f"<{e['name']}>" for e in c.get("env", [])}
            mounts = {}
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problem(cwhere, f"volumeMount {m['name']} is not a volume of the pod")
                else:
                    mounts[m["mountPath"].rstrip("/")] = volumes[m["name"]]
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c.get("args", []))):
                if ref not in env:
                    problem(cwhere, f"args use $({ref}), which is not in env")
            # The flags: flagfiles from mounted ConfigMaps, then the args.
            args = []
            for a in c.get("args", []):
                parsed = parse_flag(a)
                if parsed and parsed[0] == "flagfile":
                    text = configmap_file(parsed[1], mounts, configmaps, cwhere)
                    if text is not None:
                        args += flagfile_args(text, f"{cwhere} {parsed[1]}")
                else:
                    args.append(expand(a, env))
            values = check_flags(args, flags, cwhere)
            role = check_role(values, cwhere)
            check_listen(values, cwhere)
            check_no_daemon_optimizer(values, role, cwhere)
            # The pod network is not loopback: TLS and tokens, from Secrets.
            check_secured(values, cwhere, "the pod network")
            check_secret_files(values, mounts, copied, cwhere)
            sources = {f: mounts[os.path.dirname(values[f])]["name"] for f in SECRET_FLAGS
                       if values.get(f) and os.path.dirname(values[f]) in mounts}
            secrets = {f: sorted(copied.get(v, [])) for f, v in sources.items()}
            roles[role] = (w, values, secrets)
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            _, listen_port = host_port(values.get("listen", "0.0.0.0:7070"))
            if listen_port not in ports.values():
                problem(cwhere, f"--listen port {listen_port} is not a containerPort")
            check_probes(c, values, listen_port, health, health_flags, cwhere)
            for flag in ("recipe", "model", "restore_from", "checkpoint_dir"):
                if values.get(flag) and not any(
                    values[flag] == p or values[flag].startswith(p + "/") for p in mounts
                ):
                    problem(cwhere, f"--{flag}={values[flag]} is not under a volumeMount")
            if values.get("recipe"):
                recipe = configmap_file(values["recipe"], mounts, configmaps, cwhere)
                if recipe is not None:
                    check_recipe(hpctl, recipe, f"{cwhere} --recipe")
            if role == "daemon":
                limits = c.get("resources", {}).get("limits", {})
                if values.get("backend") == "gpu" and "nvidia.com/gpu" not in limits:
                    problem(cwhere, "--backend=gpu without resources.limits nvidia.com/gpu")
                adv_host, adv_port = host_port(values.get("advertise_address"))
                if adv_host is None:
                    problem(cwhere, "a daemon in a pod needs --advertise_address (default 127.0.0.1)")
                elif adv_port != listen_port:
                    problem(cwhere, f"--advertise_address port {adv_port} is not --listen's {listen_port}")
                else:
                    parts = adv_host.split(".")
                    svc = services.get(parts[1]) if len(parts) > 1 else None
                    if svc is None or svc["metadata"]["name"] != w["spec"].get("serviceName"):
                        problem(cwhere, f"--advertise_address {adv_host} is not <pod>.<its headless Service>")
                    else:
                        check_reachable_before_ready(svc, "the coordinator dials the daemons by it")

    # Services: their selectors pick a workload and their ports exist there.
    for name, svc in services.items():
        where = f"{svc['_file']}: Service {name}"
        selected = [
            w for w in workloads.values()
            if matches(svc["spec"].get("selector"), w["spec"]["template"]["metadata"].get("labels", {}))
        ]
        if not selected:
            problem(where, "its selector matches no workload")
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for w in selected:
                cports = [p for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
                if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
                    problem(where, f"targetPort {target} is no containerPort of {w['metadata']['name']}")

    # The world: the coordinator expects as many daemons as there are, and
    # the daemons reach it through its Service before it is ready.
    if "coordinator" not in roles or "daemon" not in roles:
        problem(directory, f"need a coordinator and daemons, found roles {sorted(roles)}")
    else:
        coordinator, cvalues, csecrets = roles["coordinator"]
        daemons, dvalues, dsecrets = roles["daemon"]
        expected = int(cvalues.get("daemons", "1"))
        if expected != daemons["spec"].get("replicas", 1):
            problem(daemons["_file"], f"replicas {daemons['spec'].get('replicas', 1)} != the coordinator's --daemons={expected}")
        host, port = host_port(dvalues.get("coordinator"))
        svc = services.get((host or "").split(".")[0])
        if svc is None:
            problem(daemons["_file"], f"--coordinator={dvalues.get('coordinator')} names no Service")
        else:
            if not matches(svc["spec"].get("selector"), coordinator["spec"]["template"]["metadata"]["labels"]):
                problem(svc["_file"], f"Service {host} does not select the coordinator")
            if port not in [p["port"] for p in svc["spec"].get("ports", [])]:
                problem(svc["_file"], f"Service {host} has no port {port}")
            check_reachable_before_ready(svc, "the daemons join through it, and the coordinator is "
                                         "ready only once they have")
        if cvalues.get("data_plane", "host") != dvalues.get("data_plane", "host"):
            problem(directory, "--data_plane differs between the coordinator and the daemons")
        for flag in ("auth_token_file", "tls_ca"):
            if csecrets.get(flag) != dsecrets.get(flag):
                problem(directory, f"--{flag} comes from Secrets {csecrets.get(flag)} on the coordinator "
                        f"but {dsecrets.get(flag)} on the daemons: one cluster, one set")
    print(f"k8s: {len(objects)} objects in {directory} checked")


def check_reachable_before_ready(svc, why):
    """A Service that processes must reach before they are ready: headless
    and publishing not-ready addresses (a ClusterIP Service routes only to
    ready pods, which would deadlock the start)."""
    where = f"{svc['_file']}: Service {svc['metadata']['name']}"
    if svc["spec"].get("clusterIP") != "None":
        problem(where, f"is not headless (clusterIP: None), but {why}")
    if not svc["spec"].get("publishNotReadyAddresses"):
        problem(where, f"needs publishNotReadyAddresses: true, because {why}")


def configmap_file(path, mounts, configmaps, where):
    directory, name = os.path.split(path)
    volume = mounts.get(directory)
    if volume is None or "configMap" not in volume:
        problem(where, f"{path} is not in a mounted ConfigMap")
        return None
    data = configmaps.get(volume["configMap"]["name"], {}).get("data", {})
    if name not in data:
        problem(where, f"ConfigMap {volume['configMap']['name']} has no key {name} for {path}")
        return None
    return data[name]


def check_recipe(hpctl, recipe, where):
    """The recipe must parse: hpctl inspect of a generated model with it."""
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m.safetensors")
        rp = os.path.join(tmp, "recipe.textproto")
        open(rp, "w").write(recipe)
        subprocess.run([hpctl, "generate", "--out", model, "--preset", "demo"], check=True,
                       capture_output=True)
        r = subprocess.run([hpctl, "inspect", model, "--recipe", rp], capture_output=True, text=True)
        if r.returncode != 0:
            problem(where, f"hpctl inspect refuses the recipe: {r.stderr.strip()[:500]}")


# ---------------------------------------------------------------- slurm


def check_slurm(binary, script, health):
    flags = known_flags(binary)
    health_flags = known_flags(health, expect=("address", "service"))
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    if r.returncode != 0:
        problem(script, f"bash -n: {r.stderr.strip()}")
        return
    # A dry run in a fake 2-node allocation with 4 GPUs per node prints every
    # srun command the launcher would run.
    env = dict(os.environ)
    env.update({
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2",
        "PARAMD_NODES": "gpu01 gpu02", "PARAMD_GPUS_PER_NODE": "4", "PARAMD_BIN": binary,
        "PARAMD_DRY_RUN": "1", "PARAMD_MODEL": "/shared/model.safetensors",
        "PARAMD_HEALTH": health,
    })
    r = subprocess.run(["bash", script, "--", "python3", "train.py"], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        problem(script, f"dry run failed (rc {r.returncode}): {r.stderr.strip()[:1000]}")
        return
    sruns = [l for l in r.stdout.splitlines() if l.startswith("srun ")]
    coordinators = [l for l in sruns if "--role=coordinator" in l]
    daemons = [l for l in sruns if "--role=daemon" in l]
    trainers = [l for l in sruns if "train.py" in l]
    if len(coordinators) != 1 or "-w gpu01" not in coordinators[0]:
        problem(script, f"want one coordinator on the first node, got {coordinators}")
    if len(daemons) != 8:
        problem(script, f"want 8 daemons (2 nodes x 4 GPUs), got {len(daemons)}")
    for l in coordinators:
        if "--daemons=8" not in l:
            problem(script, f"the coordinator does not expect 8 daemons: {l}")
    if len(trainers) != 1:
        problem(script, f"want one trainer srun, got {trainers}")
    for l in sruns:
        words = shlex.split(l)
        if binary in words:
            check_flags(words[words.index(binary) + 1:], flags, f"{script} (dry run)")
    # Up = gRPC health, asked of the coordinator before any trainer starts:
    # its service (every daemon joined), then the process (model loaded).
    lines = r.stdout.splitlines()
    trainer_at = next((i for i, l in enumerate(lines) if "train.py" in l), len(lines))
    probes = {}
    for l in lines[:trainer_at]:
        words = shlex.split(l)
        if words and words[0] == health:
            values = check_flags(words[1:], health_flags, f"{script} (dry run)")
            if values.get("address") != "gpu01:7070":
                problem(script, f"the health probe asks {values.get('address')}, not the coordinator gpu01:7070")
            probes[values.get("service") or ""] = l
    for service, meaning in (("paramd.rpc.Coordinator", "every daemon joined"),
                             ("", "the model loaded")):
        if service not in probes:
            problem(script, f"no health probe of service {service!r} ({meaning}) before the trainers start")
    if "/dev/tcp" in open(script).read():
        problem(script, "a TCP port check: a listening coordinator is not a cluster that is up")
    for n in ("gpu01", "gpu02"):
        gpus = sorted(re.search(r"--gpu=(\d+)", l).group(1) for l in daemons if f"-w {n}" in l)
        if gpus != ["0", "1", "2", "3"]:
            problem(script, f"daemons on {n} use GPUs {gpus}, want 0-3 once each")
    print(f"slurm: {script} dry run: {len(coordinators)} coordinator, {len(daemons)} daemons, "
          f"{len(probes)} health waits, {len(trainers)} trainer step")


# ---------------------------------------------------------------- docker


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command_lines(text, prefix):
    """(line number, words) of every command in `text` that starts with
    `prefix` (shell lines or Dockerfile comments, with backslash
    continuations; the number is the command's first line)."""
    found = []
    lines = text.split("\n")
    n = 0
    while n < len(lines):
        start, line = n + 1, lines[n].strip().lstrip("#").strip()
        while line.endswith("\\") and n + 1 < len(lines):
            n += 1
            line = line[:-1] + " " + lines[n].strip().lstrip("#").strip()
        n += 1
        if line.startswith(prefix + " "):
            found.append((start, shlex.split(line, comments=True)))
    return found


# `docker run` options that take a value (the ones the kit's lines use).
DOCKER_RUN_VALUE_OPTIONS = ("-p", "--publish", "-v", "--volume", "-u", "--user", "-e", "--env",
                            "--name", "--gpus", "--network", "-w", "--workdir")


def docker_run(words, image="hybrid-paramd"):
    """A `docker run [OPTIONS] IMAGE ARGS` command: ({option: [values]},
    ARGS), or None if `image` is not its image."""
    options = {}
    i = 2
    while i < len(words):
        w = words[i]
        if not w.startswith("-"):
            break
        name, eq, value = w.partition("=")
        if not eq and name in DOCKER_RUN_VALUE_OPTIONS and i + 1 < len(words):
            i += 1
            value = words[i]
        options.setdefault(name, []).append(value if (eq or name in DOCKER_RUN_VALUE_OPTIONS) else None)
        i += 1
    if i >= len(words) or words[i] != image:
        return None
    return options, words[i + 1:]


def docker_run_args(text):
    """The hybrid-paramd arguments of every `docker run ... hybrid-paramd
    ARGS` line in `text`."""
    runs = [docker_run(words) for _, words in command_lines(text, "docker run")]
    return [run[1] for run in runs if run]


def docker_volumes(options, pwd):
    """The bind mounts of `docker run` options as (container path, host
    path), "$PWD" being `pwd`; a missing host directory is created, as
    docker does."""
    volumes = []
    for spec in options.get("-v", []) + options.get("--volume", []):
        source, target = spec.split(":")[:2]
        source = source.replace("$PWD", pwd).replace("${PWD}", pwd)
        os.makedirs(source, exist_ok=True)
        volumes.append((target.rstrip("/"), source))
    return volumes


def in_volumes(arg, volumes):
    """`arg` (a path or --flag=PATH) with a container path under a bind
    mount replaced by the host path."""
    m = re.match(r"^(--[A-Za-z0-9_]+=)?(/.*)$", arg)
    if not m:
        return arg
    for target, source in sorted(volumes, key=lambda v: -len(v[0])):
        if m.group(2) == target or m.group(2).startswith(target + "/"):
            return (m.group(1) or "") + source + m.group(2)[len(target):]
    return arg


def check_quick_starts(binary, health, hpctl, make_certs, sources):
    """Runs each documented `docker run` line's arguments (without docker):
    the server must start and answer SERVING. The bind mounts' host
    directories are here, models/ and certs/ generated."""
    with tempfile.TemporaryDirectory() as tmp:
        models, certs = os.path.join(tmp, "models"), os.path.join(tmp, "certs")
        os.makedirs(models)
        subprocess.run([hpctl, "generate", "--out", os.path.join(models, "demo.safetensors"),
                        "--preset", "demo"], check=True, capture_output=True)
        subprocess.run(["bash", make_certs, certs, "IP:127.0.0.1,DNS:localhost"], check=True,
                       capture_output=True)
        fd = os.open(os.path.join(certs, "tokens"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"".join(f"{role} {os.urandom(16).hex()}\n".encode()
                              for role in ("cluster", "operator", "trainer")))
        os.close(fd)
        count = 0
        for where, text in sources:
            for line, words in command_lines(text, "docker run"):
                run = docker_run(words)
                if run is None:
                    continue
                count += 1
                options, args = run
                # The bind mounts ("$PWD" is here: models/, certs/, ...).
                args = [in_volumes(a, docker_volumes(options, tmp)) for a in args]
                run_quick_start(binary, health, args, tmp, f"{where}: docker run #{count}")
        if count == 0:
            problem(sources[0][0], "no `docker run ... hybrid-paramd ARGS` line")
    return count


def run_quick_start(binary, health, args, tmp, where):
    port = free_port()
    args = [re.sub(r"^--listen=(.*):\d+$", rf"--listen=\1:{port}", a) for a in args]
    port_file = os.path.join(tmp, f"port{port}")
    log = open(os.path.join(tmp, f"log{port}"), "w+")
    server = subprocess.Popen([binary, *args, f"--port_file={port_file}"], stdout=log, stderr=log)
    try:
        for _ in range(200):
            if os.path.exists(port_file) or server.poll() is not None:
                break
            time.sleep(0.1)
        if not os.path.exists(port_file):
            log.seek(0)
            problem(where, f"hybrid-paramd {' '.join(args)} did not start (rc {server.poll()}): "
                    f"{log.read()[-1500:]}")
            return
        probe = [health, f"--address=127.0.0.1:{port}", "--wait=30"]
        probe += [a for a in args if a.startswith("--tls_ca=")]
        if not any(a.startswith("--model=") for a in args):
            # No model yet (`hpctl load` follows): the world has formed.
            probe.append("--service=paramd.rpc.Coordinator")
        r = subprocess.run(probe, capture_output=True, text=True)
        if r.returncode != 0:
            problem(where, f"hybrid-paramd {' '.join(args)} is not SERVING: {r.stderr.strip()}")
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


def check_docker(binary, dockerfile, install_deps, readme, health, hpctl, make_certs):
    text = open(dockerfile).read()
    lines = [l.strip() for l in re.sub(r"\\\n", " ", text).splitlines()]
    froms = [l.split()[1] for l in lines if l.upper().startswith("FROM ")]
    if not froms or any(not re.match(r"^debian:(12|bookworm)(-slim)?(@sha256:[0-9a-f]+)?$", f) for f in froms):
        problem(dockerfile, f"every stage must be Debian 12 (debian:12 / debian:bookworm[-slim]), got {froms}")
    if not any("tools/install_deps.sh" in l for l in lines if l.upper().startswith("RUN ")):
        problem(dockerfile, "the build stage must install with tools/install_deps.sh")
    if not any(re.search(r"bazel build .*//server:hybrid-paramd", l) for l in lines):
        problem(dockerfile, "no `bazel build //server:hybrid-paramd`")
    # Runtime stage: every shared library the binary links must come from a
    # Debian package it installs.
    runtime = re.split(r"^FROM ", text, flags=re.M)[-1].replace("\\\n", " ")
    runtime_packages = set()
    for m in re.finditer(r"apt-get install([^\n&;]*)", runtime):
        runtime_packages |= {w for w in m.group(1).split() if re.match(r"^[a-z0-9][a-z0-9.+-]+$", w)}
    # (Every binary the image ships.)
    ldd = "".join(subprocess.run(["ldd", b], capture_output=True, text=True).stdout
                  for b in (binary, health, hpctl))
    # dpkg knows a library by one of its names: the path ldd prints, the
    # symlink's target, or either without /usr (Debian 12 merges /usr).
    names = {}
    for lib in re.findall(r"=> (/\S+)", ldd):
        forms = {lib, os.path.realpath(lib)}
        forms |= {f[len("/usr"):] for f in forms if f.startswith("/usr/")}
        names[lib] = forms
    # One dpkg -S for all (it reads the whole file database each time).
    r = subprocess.run(["dpkg", "-S"] + sorted(set().union(*names.values())),
                       capture_output=True, text=True)
    needed = set()
    owned = set()
    for line in r.stdout.splitlines():
        pkgs, _, path = line.partition(": ")
        needed |= {p.split(":")[0].strip() for p in pkgs.split(",")}
        owned.add(path.strip())
    for lib, forms in sorted(names.items()):
        if not forms & owned:
            problem(dockerfile, f"{lib} (needed by hybrid-paramd) belongs to no Debian package")
    essential = {"libc6", "libgcc-s1", "libstdc++6"}  # in every Debian image
    for pkg in sorted(needed - essential - runtime_packages):
        problem(dockerfile, f"the runtime stage does not install {pkg} (hybrid-paramd links it)")
    if not os.path.exists(install_deps):
        problem(dockerfile, f"{install_deps} does not exist")
    # The quick start: the README's container section and the Dockerfile's
    # header.
    readme_text = open(readme).read()
    section = readme_text[readme_text.find("### Container"):]
    section = section[:section.find("\n### ", 1)] if "\n### " in section[1:] else section
    runs = check_quick_starts(binary, health, hpctl, make_certs,
                              [(readme, section), (dockerfile, text)])
    print(f"docker: {dockerfile}: stages {froms}, runtime packages cover {len(needed)} linked packages; "
          f"{runs} documented docker run lines serve")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    what = sys.argv[1]
    if what == "systemd":
        check_systemd(sys.argv[2], sys.argv[3])
    elif what == "k8s":
        check_k8s(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    elif what == "slurm":
        check_slurm(sys.argv[2], sys.argv[3], sys.argv[4])
    elif what == "docker":
        check_docker(*sys.argv[2:9])
    else:
        sys.exit(__doc__)
    for p in PROBLEMS:
        print(p)
    sys.exit(1 if PROBLEMS else 0)


if __name__ == "__main__":
    main()
