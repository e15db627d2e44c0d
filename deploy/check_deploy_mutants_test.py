#!/usr/bin/env python3
"""//deploy:check_deploy_mutants_test: check_deploy.py catches each mistake
the kit must not ship. The shipped files pass; each mutant (a copy of them
with one mistake) must fail with the problem named.

  check_deploy_mutants_test.py HYBRID_PARAMD HPCTL HEALTH

Run from the repository root (Bazel runs it in the runfiles tree).
"""

import copy
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

BINARY, HPCTL, HEALTH = sys.argv[1:4]
CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_deploy.py")
failures = []


def run_check(*args):
    r = subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


# ------------------------------------------------------------------ k8s

K8S = "deploy/k8s"


def load(directory):
    docs = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".yaml"):
            docs[name] = list(yaml.safe_load_all(open(os.path.join(directory, name))))
    return docs


def find(docs, kind, name):
    for objects in docs.values():
        for o in objects:
            if o and o["kind"] == kind and o["metadata"]["name"] == name:
                return o
    raise KeyError((kind, name))


def container(docs, workload):
    return find(docs, "StatefulSet", workload)["spec"]["template"]["spec"]["containers"][0]


def configmap(docs):
    return find(docs, "ConfigMap", "hybrid-paramd-config")["data"]


def k8s_mutant(title, mutate, want):
    docs = copy.deepcopy(SHIPPED_K8S)
    mutate(docs)
    with tempfile.TemporaryDirectory() as tmp:
        for name, objects in docs.items():
            with open(os.path.join(tmp, name), "w") as f:
                yaml.safe_dump_all(objects, f)
        rc, out = run_check("k8s", BINARY, HPCTL, HEALTH, tmp)
    report(title, rc, out, want)


def report(title, rc, out, want):
    if rc == 0 or want not in out:
        failures.append(f"{title}: want a failure naming {want!r}, got rc {rc}:\n{out}")
    else:
        print(f"ok: {title}")


SHIPPED_K8S = load(K8S)
rc, out = run_check("k8s", BINARY, HPCTL, HEALTH, K8S)
if rc != 0:
    failures.append(f"the shipped manifests fail:\n{out}")


def set_key(d, key, value):
    d[key] = value


def pop_key(d, key):
    d.pop(key, None)


coordinator_svc = lambda docs: find(docs, "Service", "hybrid-paramd-coordinator")["spec"]
k8s_mutant("coordinator Service routes only to ready pods",
           lambda docs: pop_key(coordinator_svc(docs), "publishNotReadyAddresses"),
           "needs publishNotReadyAddresses")
k8s_mutant("coordinator Service with a cluster IP",
           lambda docs: pop_key(coordinator_svc(docs), "clusterIP"), "is not headless")
k8s_mutant("daemon Service routes only to ready pods",
           lambda docs: pop_key(find(docs, "Service", "hybrid-paramd-daemon")["spec"],
                                "publishNotReadyAddresses"),
           "needs publishNotReadyAddresses")
k8s_mutant("a daemon optimizer flag",
           lambda docs: set_key(configmap(docs), "daemon.flags",
                                configmap(docs)["daemon.flags"] + "--lr=1e-4\n"),
           "daemon optimizer flags --lr")
k8s_mutant("no TLS",
           lambda docs: set_key(configmap(docs), "daemon.flags", "\n".join(
               l for l in configmap(docs)["daemon.flags"].splitlines() if "--tls_" not in l) + "\n"),
           "without TLS")
k8s_mutant("no tokens",
           lambda docs: set_key(configmap(docs), "coordinator.flags", "\n".join(
               l for l in configmap(docs)["coordinator.flags"].splitlines()
               if "--auth_token_file" not in l) + "\n"),
           "no --auth_token_file")
k8s_mutant("Kubernetes' gRPC probe against TLS",
           lambda docs: set_key(container(docs, "hybrid-paramd-coordinator"), "readinessProbe",
                                {"grpc": {"port": 7070}}),
           "speaks no TLS")
k8s_mutant("liveness on health",
           lambda docs: set_key(container(docs, "hybrid-paramd-daemon"), "livenessProbe",
                                copy.deepcopy(container(docs, "hybrid-paramd-daemon")["readinessProbe"])),
           "livenessProbe is gRPC health")
k8s_mutant("no readiness probe",
           lambda docs: pop_key(container(docs, "hybrid-paramd-daemon"), "readinessProbe"),
           "no readinessProbe")


def mount_secret_directly(docs):
    c = container(docs, "hybrid-paramd-coordinator")
    for m in c["volumeMounts"]:
        if m["name"] == "secrets":
            m["name"] = "tokens"


k8s_mutant("tokens read straight from a Secret volume", mount_secret_directly,
           "read straight from Secret volume")


def copy_without_mode(docs):
    pod = find(docs, "StatefulSet", "hybrid-paramd-daemon")["spec"]["template"]["spec"]
    pod["initContainers"][0]["command"] = ["sh", "-c", "cp /secrets/tls/* /secrets/tokens/* /run/hybrid-paramd/secrets/"]


k8s_mutant("secrets copied with the Secret's mode", copy_without_mode,
           "without making the files 0600")
k8s_mutant("a gpu daemon without a GPU",
           lambda docs: container(docs, "hybrid-paramd-daemon")["resources"]["limits"].pop("nvidia.com/gpu"),
           "nvidia.com/gpu")
k8s_mutant("replicas != --daemons",
           lambda docs: set_key(find(docs, "StatefulSet", "hybrid-paramd-daemon")["spec"], "replicas", 3),
           "replicas 3 != the coordinator's --daemons=2")


# ------------------------------------------------------------------ systemd

SYSTEMD = "deploy/systemd"
rc, out = run_check("systemd", BINARY, SYSTEMD)
if rc != 0:
    failures.append(f"the shipped systemd files fail:\n{out}")


def text_mutant(kind, directory, title, file, old, new, want):
    """A copy of `directory` with `old` replaced by `new` in `file`."""
    with tempfile.TemporaryDirectory() as tmp:
        copy_dir = os.path.join(tmp, os.path.basename(directory))
        shutil.copytree(directory, copy_dir)
        path = os.path.join(copy_dir, file)
        text = open(path).read()
        if old not in text:
            failures.append(f"{title}: {file} has no {old!r} to change")
            return
        open(path, "w").write(text.replace(old, new, 1))
        rc, out = run_check(kind, BINARY, copy_dir)
    report(title, rc, out, want)


UNIT = "hybrid-paramd@.service"
text_mutant("systemd", SYSTEMD, "systemd: a daemon optimizer flag", "daemon0.flags",
            "--role=daemon\n", "--role=daemon\n--lr=1e-4\n", "daemon optimizer flags --lr")
text_mutant("systemd", SYSTEMD, "systemd: the token file read from /etc by the dynamic user", UNIT,
            "--auth_token_file=%d/tokens", "--auth_token_file=/etc/hybrid-paramd/tokens",
            "a DynamicUser cannot read a root-owned")
text_mutant("systemd", SYSTEMD, "systemd: a credential never loaded", UNIT,
            "LoadCredential=tokens:/etc/hybrid-paramd/credentials/tokens\n", "",
            "no LoadCredential=tokens")
text_mutant("systemd", SYSTEMD, "systemd: a secret flag in a flagfile", "coordinator.flags",
            "--role=coordinator\n", "--role=coordinator\n--tls_ca=/etc/hybrid-paramd/ca.pem\n",
            "--tls_ca in a flagfile")
text_mutant("systemd", SYSTEMD, "systemd: no TLS", UNIT,
            "--tls_cert=%d/server.pem --tls_key=%d/server.key ", "", "without TLS")
text_mutant("systemd", SYSTEMD, "systemd: a key the unit does not know", UNIT,
            "DynamicUser=yes", "DynamicUser=yes\nNoSuchKey=1", "systemd-analyze verify")

for f in failures:
    print("FAIL:", f)
print(f"{len(failures)} failed" if failures else "all mutants caught")
sys.exit(1 if failures else 0)
