#!/usr/bin/env bash
# //deploy:slurm_test: hybrid-paramd.sbatch in a real single-node Slurm
# (slurmctld + slurmd + munged from Debian's slurm-wlm, all on localhost,
# in a private directory with free ports). The batch job starts the
# coordinator and 2 daemons (CPU backend) through the launcher and runs a
# "trainer" step that checks the cluster once with hpctl, as it is when the
# launcher says it is up: both daemons joined, the model loaded; then one
# admin step. A second job whose daemon 1 cannot start (its port is taken)
# must fail before any trainer runs. Then every process must be gone.
# Args: HYBRID_PARAMD HPCTL LAUNCHER HYBRID_PARAMD_HEALTH. Needs root
# (slurmd launches the steps).
set -euo pipefail
BIN=$(realpath "$1"); HPCTL=$(realpath "$2"); LAUNCHER=$(realpath "$3"); HEALTH=$(realpath "$4")
if [ "$(id -u)" != 0 ]; then echo "slurm_test: needs root (slurmd)" >&2; exit 1; fi
for tool in munged slurmctld slurmd sbatch scontrol; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin
  command -v "$tool" >/dev/null || { echo "slurm_test: $tool missing (apt-get install slurm-wlm)" >&2; exit 1; }
done
# Under /tmp, not TEST_TMPDIR: munged's socket path must fit in 108 bytes.
T=$(mktemp -d /tmp/paramd-slurm.XXXXXX)
chmod 755 "$T"
mkdir -p "$T/state" "$T/spool" "$T/log" "$T/work"
cleanup() {
  for f in slurmd slurmctld munged; do
    [ -f "$T/$f.pid" ] && kill "$(cat "$T/$f.pid")" 2>/dev/null || true
  done
  sleep 0.5
  rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "slurm_test: $*" >&2
  for f in "$T"/log/* "$T"/work/job.out; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done >&2
  exit 1
}
# free_port [N]: a loopback port P with P..P+N-1 all free (N defaults to 1).
free_port() {
  python3 - "${1:-1}" <<'PY'
import socket, sys
n = int(sys.argv[1])
for _ in range(100):
    held = [socket.socket()]
    try:
        held[0].bind(("127.0.0.1", 0))
        p = held[0].getsockname()[1]
        for i in range(1, n):
            held.append(socket.socket())
            held[-1].bind(("127.0.0.1", p + i))
        print(p)
        break
    except OSError:
        pass
    finally:
        for s in held:
            s.close()
else:
    sys.exit(f"no {n} free consecutive ports")
PY
}
CTLD_PORT=$(free_port); D_PORT=$(free_port); PARAMD_PORT=$(free_port)
# The launcher gives daemon g the port PARAMD_DAEMON_PORT + g (2 daemons).
DAEMON_PORT=$(free_port 2)

dd if=/dev/urandom of="$T/munge.key" bs=1024 count=1 2>/dev/null
chmod 600 "$T/munge.key"
munged --key-file="$T/munge.key" --socket="$T/munge.sock" --pid-file="$T/munged.pid" \
  --log-file="$T/log/munged.log" --seed-file="$T/munge.seed" -f || fail "munged did not start"

cat > "$T/slurm.conf" <<CONF
ClusterName=paramdtest
SlurmctldHost=localhost
AuthType=auth/munge
AuthInfo=socket=$T/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=10 State=UP
CONF
export SLURM_CONF=$T/slurm.conf
slurmctld -c -i || fail "slurmctld did not start"
slurmd -N localhost || fail "slurmd did not start"
for _ in $(seq 50); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 0.2
done
sinfo -h -o %t | grep -q idle || fail "the node did not become idle"

"$HPCTL" generate --out "$T/work/model.safetensors" --preset demo >/dev/null
# The "trainer": one task; it sees PARAMD_COORDINATOR from the launcher.
cat > "$T/work/trainer.sh" <<TRAINER
#!/usr/bin/env bash
set -eu
echo "trainer \$SLURM_PROCID of \$SLURM_NTASKS: coordinator \$PARAMD_COORDINATOR"
# Once, no waiting: the launcher starts trainers only on a cluster that is up.
"$HPCTL" status --address="\$PARAMD_COORDINATOR" --timeout=2 2>&1 || true
"$HPCTL" step --address="\$PARAMD_COORDINATOR"
TRAINER
chmod +x "$T/work/trainer.sh"

start=$SECONDS
cd "$T/work"
PARAMD_BIN=$BIN PARAMD_HEALTH=$HEALTH PARAMD_PORT=$PARAMD_PORT PARAMD_DAEMON_PORT=$DAEMON_PORT \
  PARAMD_GPUS_PER_NODE=2 PARAMD_TRAINERS_PER_NODE=1 PARAMD_EXPECTED_PUSHERS=0 \
  PARAMD_MODEL="$T/work/model.safetensors" PARAMD_DAEMON_ARGS=--backend=cpu \
  sbatch --wait --nodes=1 --time=5 --output="$T/work/job.out" "$LAUNCHER" -- "$T/work/trainer.sh" \
  >/dev/null || fail "the batch job failed"
echo "slurm_test: job done in $((SECONDS - start)) s"
out=$(cat "$T/work/job.out")
for want in "hybrid-paramd: up: coordinator localhost:$PARAMD_PORT, 2 daemon(s)" \
            "trainer 0 of 1: coordinator localhost:$PARAMD_PORT" "committed version 0" \
            "stepped from version 0; committed version 1"; do
  grep -qF "$want" <<< "$out" || fail "job output lacks '$want'"
done
for port in "$DAEMON_PORT" "$((DAEMON_PORT + 1))"; do
  grep -qE "^ +[01] +localhost:$port " <<< "$out" || fail "hpctl status lists no daemon at localhost:$port"
done

# Half a cluster is not up: daemon 1's port is taken, so it exits; the job
# fails without starting the trainer.
FIRST_PORT=$PARAMD_PORT
PARAMD_PORT=$(free_port)
# The squatter holds daemon 1's port; another process may take a port that
# free_port found free before the squatter binds it, so try a few.
squatter=
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  DAEMON_PORT=$(free_port 2)
  rm -f "$T/work/squatting"
  python3 -c "
import socket, time
s = socket.socket(); s.bind(('0.0.0.0', $((DAEMON_PORT + 1)))); s.listen(1)
open('$T/work/squatting', 'w').close(); time.sleep(120)
" 2>/dev/null &
  squatter=$!
  for _ in $(seq 50); do
    [ -e "$T/work/squatting" ] && break
    kill -0 "$squatter" 2>/dev/null || break
    sleep 0.1
  done
  [ -e "$T/work/squatting" ] && break
  kill "$squatter" 2>/dev/null || true
  squatter=
done
[ -n "$squatter" ] || fail "no port to squat on for daemon 1 after 10 tries"
start=$SECONDS
if PARAMD_BIN=$BIN PARAMD_HEALTH=$HEALTH PARAMD_PORT=$PARAMD_PORT PARAMD_DAEMON_PORT=$DAEMON_PORT \
     PARAMD_GPUS_PER_NODE=2 PARAMD_TRAINERS_PER_NODE=1 PARAMD_EXPECTED_PUSHERS=0 \
     PARAMD_MODEL="$T/work/model.safetensors" PARAMD_DAEMON_ARGS=--backend=cpu \
     PARAMD_START_TIMEOUT=60 \
     sbatch --wait --nodes=1 --time=5 --output="$T/work/job2.out" "$LAUNCHER" -- "$T/work/trainer.sh" \
     >/dev/null; then
  kill "$squatter" 2>/dev/null || true
  fail "the job with a daemon that cannot start succeeded: $(cat "$T/work/job2.out")"
fi
kill "$squatter" 2>/dev/null || true
wait "$squatter" 2>/dev/null || true
echo "slurm_test: half-started job failed in $((SECONDS - start)) s"
out=$(cat "$T/work/job2.out")
grep -qF "exited before every daemon joined" <<< "$out" || fail "job 2 output lacks the reason: $out"
if grep -qF "trainer 0 of" <<< "$out" || grep -qF "hybrid-paramd: up" <<< "$out"; then
  fail "job 2 reported the cluster up or ran the trainer: $out"
fi
# Nothing the job started may survive it.
sleep 1
for port in "$FIRST_PORT" "$PARAMD_PORT"; do
  if pgrep -f -- "--coordinator=localhost:$port" >/dev/null ||
     pgrep -f -- "--listen=0.0.0.0:$port" >/dev/null; then
    fail "hybrid-paramd processes left after a job: $(pgrep -af -- ":$port")"
  fi
done
echo "slurm_test: OK"
