#!/usr/bin/env bash
# Run a command with its memory capped: a cgroup v1 memory cgroup of our own (a child of the
# one this process is in, named clusterip-cap-<pid>-<start>), memory.limit_in_bytes = MiB.
# The command and everything it starts are in it; past the cap the kernel's OOM killer picks
# inside it, nothing else on the machine. The cgroup is removed when the command ends, and
# on INT/TERM/HUP (the command gets TERM, then after CLUSTERIP_CAP_GRACE_S seconds, default
# 10, every task left gets KILL); if this script itself is SIGKILLed, the next
# `scripts/dev-cluster.sh reap` kills what is left in it and removes it.
#
#   scripts/lib/run-capped.sh <MiB> -- command args...
#
# Exit status: the command's (137 when the cap's OOM killer took it). On stderr at the end:
# "run-capped: <command> peak <n> MiB of <MiB> MiB cap[, OOM kills: <k>]". Processes the
# command left running are killed and named ("run-capped: leftover process killed …").
# The command sees CLUSTERIP_CAP_CGROUP=<cgroup directory>.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=owners.sh
. "$here/owners.sh"

usage() { echo "usage: $0 <MiB> -- command args..." >&2; exit 2; }
if [ $# -lt 3 ] || [ "$2" != -- ]; then usage; fi
mib=$1; shift 2
[[ $mib =~ ^[1-9][0-9]*$ ]] || usage

root=$CGROUP_MEMORY_ROOT
[ -f "$root/memory.limit_in_bytes" ] ||
  { echo "run-capped: no cgroup v1 memory hierarchy at $root; cannot cap $1" >&2; exit 1; }
cur=$(cgroup_of memory) || { echo "run-capped: no memory cgroup in /proc/$$/cgroup" >&2; exit 1; }
cg=$root${cur%/}/clusterip-cap-$$-$(proc_start $$)
mkdir "$cg" || { echo "run-capped: cannot create $cg (root needed)" >&2; exit 1; }
what="$*"; what=${what:0:80}
child=

# shellcheck disable=SC2317  # (called from the EXIT trap)
cleanup() {
  local rc=$? peak oom
  trap - EXIT INT TERM HUP
  # Whoever read our stderr may be gone (a killed bench): a message must not end the
  # clean-up (SIGPIPE, or set -e on a failed write) before the cgroup is removed.
  trap '' PIPE
  set +e
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
    disown "$child" 2>/dev/null || true   # (no "Killed" job notice from bash)
    kill -TERM "$child" 2>/dev/null || true
    local deadline=$((SECONDS + ${CLUSTERIP_CAP_GRACE_S:-10}))
    while kill -0 "$child" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
  fi
  peak=$(( $(cat "$cg/memory.max_usage_in_bytes" 2>/dev/null || echo 0) / 1048576 ))
  oom=$(sed -n 's/^oom_kill //p' "$cg/memory.oom_control" 2>/dev/null || true)
  # Whatever is left (the command's leftovers, or all of it after the grace period).
  local deadline=$((SECONDS + 30)) p procs seen=" "
  while procs=$(cat "$cg/cgroup.procs" 2>/dev/null) && [ -n "$procs" ]; do
    for p in $procs; do
      [[ $seen == *" $p "* ]] || { echo "run-capped: leftover process killed $(proc_desc "$p")" >&2; seen+="$p "; }
      kill -KILL "$p" 2>/dev/null || true
    done
    [ "$SECONDS" -lt "$deadline" ] || { echo "run-capped: tasks left in $cg after 30s" >&2; break; }
    sleep 0.1
  done
  rmdir "$cg" 2>/dev/null || echo "run-capped: could not remove $cg" >&2
  echo "run-capped: $what peak ${peak} MiB of ${mib} MiB cap${oom:+, OOM kills: $oom}" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

echo $((mib * 1048576)) > "$cg/memory.limit_in_bytes"
export CLUSTERIP_CAP_CGROUP=$cg
# The child joins the cgroup before it execs the command (so the command's first byte is
# charged there), with the default INT/QUIT dispositions a foreground command would have.
( trap - INT QUIT; echo "$BASHPID" > "$cg/cgroup.procs"; exec "$@" ) &
child=$!
set +e
wait "$child" 2>/dev/null   # (no "Killed" job notice: the summary line says what happened)
rc=$?
set -e
child=
exit "$rc"
