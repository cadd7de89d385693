#!/usr/bin/env bash
# A throwaway 2-node SLURM cluster on this machine, to try the course's SLURM paths without a
# cluster (chapter 03's slurm_torchrun.sbatch, the autograder's autograder/slurm/submit_grading.sh).
#
#     sudo slurm/start_local_cluster.sh [DIR]      # prints: export SLURM_CONF=DIR/etc/slurm.conf
#     sudo slurm/stop_local_cluster.sh DIR         # stops it by the pids in DIR/run, keeps DIR
#
# Run as root (slurmd starts jobs as their owner's user), with Debian/Ubuntu's packages
# slurmctld, slurmd, slurm-client and munge installed (`apt-get install --no-install-recommends
# slurmctld slurmd slurm-client munge`). Nothing of the system's own SLURM or MUNGE is used or
# touched: everything lives in DIR (default: a new /tmp/ddpcourse-slurm.XXXXXX) - its own munge
# key and socket, slurm.conf, state, spool, logs and pid files - and the daemons listen on ports
# chosen free at start-up, never fixed ones. What it does change outside DIR: /etc/hosts gets a
# line `127.0.0.1 n1 n2` (added once, only if the names do not resolve yet), so that a job's
# node list names hosts that resolve, as torchrun's MASTER_ADDR needs.
#
# The cluster: a controller (slurmctld) and NODES slurmd daemons (n1, n2, ...; NODES=2 by
# default), one per emulated node, all on 127.0.0.1 with a port each (Debian builds slurmd with
# MULTIPLE_SLURMD), each declaring CPUS_PER_NODE CPUs (default 4, whatever this machine has:
# SlurmdParameters=config_overrides) and this machine's memory; one partition `local` holding
# every node. Use it from any shell with `export SLURM_CONF=DIR/etc/slurm.conf`; then sbatch,
# srun, squeue, scontrol and scancel talk to it. Jobs run as the user who submits them; DIR is
# made readable for everyone (its munge socket must be reachable by a job's srun).
set -euo pipefail

die() { echo "start_local_cluster: $*" >&2; exit 1; }

(( $(id -u) == 0 )) || die "run it as root (slurmd starts jobs as their owners)"
for tool in munged slurmctld slurmd sbatch srun scontrol sinfo python3; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge"
done

nodes=${NODES:-2}
cpus=${CPUS_PER_NODE:-4}
here=$(cd "$(dirname "$0")" && pwd)
if (($#)); then
    dir=$1
    mkdir -p "$dir"
    [[ -z $(ls -A "$dir") ]] || die "$dir is not empty: give a new or empty folder"
else
    dir=$(mktemp -d /tmp/ddpcourse-slurm.XXXXXX)
fi
dir=$(cd "$dir" && pwd)
chmod 755 "$dir"
mkdir -p "$dir"/{etc,munge,state,spool,log,run}
chmod 755 "$dir"/munge

names=()
for ((i = 1; i <= nodes; i++)); do names+=("n$i"); done

# /etc/hosts: the node names must resolve (a job's MASTER_ADDR is the first node's name).
missing=()
for name in "${names[@]}"; do
    address=$(getent hosts "$name" | awk '{print $1; exit}') || true
    if [[ -z $address ]]; then
        missing+=("$name")
    elif [[ $address != 127.* ]]; then
        die "the host name $name already means $address here; this cluster needs it for 127.0.0.1"
    fi
done
if ((${#missing[@]})); then
    echo "127.0.0.1 ${missing[*]}  # ddp-course local SLURM cluster (slurm/start_local_cluster.sh)" >> /etc/hosts
    echo "added to /etc/hosts: 127.0.0.1 ${missing[*]}"
fi

# ports: SlurmctldPort, then one SlurmdPort per node, all free now (bound at once, then released)
read -r -a ports < <(python3 - "$((nodes + 1))" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

host=$(hostname -s)
memory=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
conf=$dir/etc/slurm.conf
{
    echo "# written by slurm/start_local_cluster.sh: a throwaway cluster in $dir"
    echo "ClusterName=ddpcourse"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=${ports[0]}"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$dir/munge/munge.socket"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
    echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "KillWait=5"
    echo "InactiveLimit=0"
    echo "MinJobAge=600"
    for ((i = 0; i < nodes; i++)); do
        echo "NodeName=${names[i]} NodeAddr=127.0.0.1 NodeHostname=$host Port=${ports[i + 1]} CPUs=$cpus RealMemory=$memory State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP"
} > "$conf"
chmod 644 "$conf"
export SLURM_CONF=$conf

up=no
cleanup_on_failure() {
    if [[ $up != yes ]]; then
        echo "start_local_cluster: bring-up failed; the logs:" >&2
        tail -n 20 "$dir"/log/* >&2 2>/dev/null || true
        "$here/stop_local_cluster.sh" "$dir" >&2 || true
    fi
}
trap cleanup_on_failure EXIT

# munge: a key of its own, a socket of its own (slurm.conf's AuthInfo names it)
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed"
slurmctld -f "$conf"
for name in "${names[@]}"; do
    slurmd -f "$conf" -N "$name"
done

# ready when every node is idle (registered with the controller)
for ((try = 0; try < 120; try++)); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    if [[ -n $states ]] && (( $(grep -c ' idle$' <<<"$states") == nodes )); then
        up=yes
        break
    fi
    sleep 0.25
done
[[ $up == yes ]] || die "the nodes did not come up within 30 s: ${states:-no answer from slurmctld}"
echo "cluster up in $dir ($(sinfo -V)): nodes ${names[*]}, $cpus CPUs each, controller port ${ports[0]}"
echo "export SLURM_CONF=$conf"
