#!/usr/bin/env bash
# Stop the cluster that slurm/start_local_cluster.sh started in DIR, by the pids in DIR/run:
#
#     sudo slurm/stop_local_cluster.sh DIR
#
# First cancels every job still queued or running and waits (up to 20 s) for them to end, so that
# no job step outlives the cluster; then sends SIGTERM to each daemon (slurmd, slurmctld, munged)
# whose pid file names a live process of that name, and SIGKILL to any still running 10 s later.
# Last, should a job's process or a job step's slurmstepd have outlived all that (a node's daemon
# killed before its jobs), it is killed too: each carries SLURM_CONF=DIR/etc/slurm.conf in its
# environment (and a job's process SLURM_JOB_ID), which is what marks it. DIR stays (its logs
# tell what happened); delete it yourself. Never touches any other process.
set -uo pipefail

(($# == 1)) || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$(cd "$1" && pwd) || exit 2
conf=$dir/etc/slurm.conf
# not exported: this script's own processes must not carry the cluster's mark
squeue() { SLURM_CONF=$conf command squeue "$@"; }
scancel() { SLURM_CONF=$conf command scancel "$@"; }

alive() {  # alive PID NAME: PID is a running process called NAME (guards against a reused pid)
    [[ -r /proc/$1/comm ]] && [[ $(cat "/proc/$1/comm" 2>/dev/null) == "$2"* ]]
}

if [[ -r $dir/run/slurmctld.pid ]] && alive "$(cat "$dir/run/slurmctld.pid")" slurmctld; then
    jobs=$(squeue -h -o %A 2>/dev/null)
    # shellcheck disable=SC2086  # a list of job ids
    [[ -n $jobs ]] && scancel --full --quiet $jobs 2>/dev/null
    for ((try = 0; try < 80; try++)); do
        [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
        sleep 0.25
    done
fi

pids=() names=()
for file in "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid "$dir"/run/munged.pid; do
    [[ -r $file ]] || continue
    pid=$(cat "$file")
    name=$(basename "$file" .pid)
    name=${name%%-*}
    if alive "$pid" "$name"; then
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid") && names+=("$name")
    fi
done
for ((try = 0; try < 40; try++)); do
    left=()
    for i in "${!pids[@]}"; do alive "${pids[i]}" "${names[i]}" && left+=("$i"); done
    ((${#left[@]})) || break
    sleep 0.25
done
for i in "${left[@]}"; do
    echo "stop_local_cluster: ${names[i]} (pid ${pids[i]}) ignored SIGTERM: killed" >&2
    kill -KILL "${pids[i]}" 2>/dev/null
done

strays=()
for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    [[ $pid != "$$" ]] || continue
    entries=$(tr '\0' '\n' < "$environ" 2>/dev/null) || continue
    grep -qxF "SLURM_CONF=$conf" <<<"$entries" || continue
    # a job's process (SLURM_JOB_ID) or a job step's manager; never, say, the shell that
    # exported SLURM_CONF to use the cluster
    if grep -q '^SLURM_JOB_ID=' <<<"$entries" || [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]]; then
        kill -KILL "$pid" 2>/dev/null && strays+=("$pid")
    fi
done
if ((${#strays[@]})); then
    echo "stop_local_cluster: killed what outlived the daemons: ${strays[*]}" >&2
fi
echo "cluster in $dir stopped (${#pids[@]} daemons)"
