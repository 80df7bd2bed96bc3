#!/bin/bash
# Run a command with its whole process tree held to CPUS of the machine's cores (a cgroup v1 CPU quota, 10 ms
# periods): a stand-in for a slower VM when its kind cannot be had. Needs root and the cgroup v1 cpu controller.
#   experiments/qos/cpu_quota.sh 1.25 .venv/bin/python experiments/qos/bench.py --phases predict --clients 1 64
set -eu
cpus=${1:?usage: cpu_quota.sh CPUS COMMAND...}; shift
root=/sys/fs/cgroup/cpu
[ -w "$root" ] || { echo "cpu_quota.sh: $root is not a writable cgroup v1 cpu controller" >&2; exit 2; }
group=$root/nexus_quota_$$
mkdir "$group"
trap 'echo $$ > "$root/cgroup.procs"; rmdir "$group" 2>/dev/null || true' EXIT
echo 10000 > "$group/cpu.cfs_period_us"
quota=$(awk "BEGIN { q = int($cpus * 10000); if (q >= 1000) print q }")
[ -n "$quota" ] || { echo "cpu_quota.sh: CPUS must be a number of at least 0.1, got '$cpus'" >&2; exit 2; }
echo "$quota" > "$group/cpu.cfs_quota_us"
echo $$ > "$group/cgroup.procs"
"$@"
grep -E "nr_periods|nr_throttled|throttled_time" "$group/cpu.stat" >&2
