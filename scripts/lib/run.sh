# shellcheck shell=bash
# A run: scripts/test.sh, the bench scripts, scripts/test-soak.sh. Sourced; then
#
#   run_begin NAME     reap what dead runs left (scripts/dev-cluster.sh reap), move this shell
#                      into a pids cgroup of its own (<cur>/clusterip/run-<pid>-<start>; every
#                      process started from now on inherits it, setsid or not), and export
#                      CLUSTERIP_OWNER_PID=$$ (clusters started by the run are owned by it)
#   run_end            (last thing of the EXIT trap) kill whatever the run left running,
#                      printing each as "NAME: leftover process <pid> <args>", and remove
#                      the cgroup
#   run_capped MIB "$@"  (benches, before run_begin) re-run this script under
#                      scripts/lib/run-capped.sh MIB, once (MIB 0: no cap)
#
# A run killed with SIGKILL cannot clean up: the next `reap` (every run and `dev-cluster.sh
# up` start with one) finds its cgroup's owner gone and kills and removes all of it.
# CLUSTERIP_RUN_CGROUP=0 runs without a cgroup (processes then are not tracked).
# shellcheck source=owners.sh
. "$(dirname "${BASH_SOURCE[0]}")/owners.sh"

run_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
run_name=run

run_begin() {
  run_name=${1:-run}
  "$run_repo/scripts/dev-cluster.sh" reap >&2 || echo "$run_name: reap reported errors (above); going on" >&2
  if [ "${CLUSTERIP_RUN_CGROUP:-}" = 0 ]; then
    unset CLUSTERIP_RUN_CGROUP
  elif ! run_cgroup_enter; then
    echo "$run_name: running without a cgroup of its own: processes this run leaves behind are not reaped" >&2
    unset CLUSTERIP_RUN_CGROUP
  fi
  export CLUSTERIP_OWNER_PID=$$
}

run_end() {
  [ -n "${CLUSTERIP_RUN_CGROUP:-}" ] || return 0
  run_cgroup_leave "$run_name:" || true
}

# (The script is found as scripts/<its name>: benches cd to the repository before this.)
run_capped() {
  local mib=$1; shift
  [ -n "${CLUSTERIP_CAPPED_RUN:-}" ] && return 0
  [ "$mib" = 0 ] && return 0
  export CLUSTERIP_CAPPED_RUN=1
  exec "$run_repo/scripts/lib/run-capped.sh" "$mib" -- "$run_repo/scripts/${0##*/}" "$@"
}
