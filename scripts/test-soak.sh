#!/usr/bin/env bash
# Soak: the README's test command (scripts/test.sh) N times in a row while a bounded CPU load
# (stress-ng) competes for the cores; per-test failure counts and, after each run, what it
# left behind.
#
#   scripts/test-soak.sh N                       # N full runs of scripts/test.sh
#   scripts/test-soak.sh N --test control_plane  # extra arguments go to scripts/test.sh
#
# Env:
#   SOAK_LOAD_CPUS       stress-ng CPU workers (default 2; 0: no load)
#   SOAK_LOAD_PERCENT    load per worker, percent (default 100)
#   SOAK_LOAD_TIMEOUT_S  the load stops by itself after this (default N x 1800 s); it is also
#                        killed when the soak ends, however it ends
#
# After each run it prints the failed tests ("<test binary>: <test>", from cargo's
# "test X ... FAILED" lines; a run that failed without such a line counts as "<run>") and the
# leftovers: processes scripts/test.sh had to kill at its end ("leftover process killed"),
# anything still in this soak's cgroup, and network namespaces cip<pid>x*, data directories
# clusterip-*, memory caps and port-registry lines that appeared during the run and whose
# owner is gone (on a shared machine another run's crash in that window shows up here too).
# New clusterip-* directories without an owner are listed but not counted.
# At the end: failures per test over the N runs. Exit status 1 if any run failed or leaked.
# Logs: target/soak/<date>-<pid>/run-<i>.log.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. scripts/lib/run.sh

n=${1:-}
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 N [scripts/test.sh arguments]" >&2; exit 2; }
shift
cpus=${SOAK_LOAD_CPUS:-2}
percent=${SOAK_LOAD_PERCENT:-100}
load_timeout=${SOAK_LOAD_TIMEOUT_S:-$((n * 1800))}

[ "$cpus" = 0 ] || scripts/lib/ensure-packages.sh stress-ng
run_begin soak
logs="$repo/target/soak/$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$logs"

load_pid=
stop_load() {
  [ -n "$load_pid" ] || return 0
  # stress-ng runs in a session (and process group) of its own: the group goes.
  kill -TERM -- "-$load_pid" 2>/dev/null || true
  local deadline=$((SECONDS + 10))
  while kill -0 -- "-$load_pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
  kill -KILL -- "-$load_pid" 2>/dev/null || true
  wait "$load_pid" 2>/dev/null || true
  load_pid=
}
trap 'stop_load; run_end' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$cpus" != 0 ]; then
  setsid stress-ng --cpu "$cpus" --cpu-load "$percent" --timeout "${load_timeout}s" --quiet </dev/null >"$logs/stress-ng.log" 2>&1 &
  load_pid=$!
  echo "soak: background load: stress-ng --cpu $cpus --cpu-load $percent --timeout ${load_timeout}s (pid $load_pid)" >&2
fi

# What exists now, one name a line (compared before and after each run).
netns_now() { for f in /run/netns/cip*; do [ -e "$f" ] && echo "${f##*/}"; done; return 0; }
dirs_now() {
  local root d
  while IFS= read -r root; do for d in "$root"/clusterip-*/; do [ -d "$d" ] && echo "${d%/}"; done; done < <(tmp_roots)
  return 0
}
caps_now() { find "$CGROUP_MEMORY_ROOT" -type d -name 'clusterip-cap-*' 2>/dev/null || true; }

# Leftovers of run $1 (log $2), given the snapshots taken before it; one line each.
leftovers() {
  local log=$1 x pid start p
  grep -h 'leftover process killed' "$log" || true
  # Still in this soak's cgroup tree: anything but this script, this subshell, their own
  # helpers (the listing's process substitution may still be exiting when mapfile returns:
  # a child of ours, while anything a run left behind has been reparented away from us) and
  # the load.
  if [ -n "${CLUSTERIP_RUN_CGROUP:-}" ]; then
    local procs stat
    mapfile -t procs < <(cgroup_tree_procs "$CLUSTERIP_RUN_CGROUP")
    for p in "${procs[@]}"; do
      [ "$p" = $$ ] || [ "$p" = "$BASHPID" ] || ! pid_alive "$p" && continue
      # Fields after the command: state, ppid, pgrp (/proc/<pid>/stat fields 3, 4, 5).
      if { read -r stat < "/proc/$p/stat"; } 2>/dev/null; then
        read -r -a stat <<< "${stat##*) }"
        [ "${stat[1]}" = $$ ] || [ "${stat[1]}" = "$BASHPID" ] && continue
        [ -n "$load_pid" ] && [ "${stat[2]}" = "$load_pid" ] && continue
      fi
      echo "process still running: $(proc_desc "$p")"
    done
    find "$CLUSTERIP_RUN_CGROUP" -mindepth 1 -type d -name 'run-*' -printf 'cgroup left: %p\n' 2>/dev/null || true
  fi
  while read -r x; do
    [[ $x =~ ^cip([0-9]+)x ]] && ! pid_alive "${BASH_REMATCH[1]}" && echo "netns left: $x"
  done < <(comm -13 "$logs/netns.before" <(netns_now | sort))
  while read -r x; do
    [ -d "$x" ] || continue
    if [ -f "$x/owner" ]; then
      owner_file_alive "$x/owner" || echo "dir left: $x (owner $(cut -d' ' -f1 "$x/owner") gone)"
    else
      echo "(not counted) new dir without owner: $x" >&2
    fi
  done < <(comm -13 "$logs/dirs.before" <(dirs_now | sort))
  while read -r x; do
    read -r pid start < <(name_owner "${x##*/}" clusterip-cap-) || continue
    owner_alive "$pid" "$start" || echo "memory cgroup left: $x"
  done < <(comm -13 "$logs/caps.before" <(caps_now | sort))
  if [ -f "${TMPDIR:-/tmp}/clusterip-dev-cluster.ports" ]; then
    awk '{ print $1 }' "${TMPDIR:-/tmp}/clusterip-dev-cluster.ports" | sort -u | while read -r x; do
      [ -d "$x" ] || echo "port registry names a removed cluster: $x"
    done
  fi
}

declare -A failed_count=()
bad_runs=0
for i in $(seq 1 "$n"); do
  netns_now | sort > "$logs/netns.before"
  dirs_now | sort > "$logs/dirs.before"
  caps_now | sort > "$logs/caps.before"
  log="$logs/run-$i.log"
  t0=$SECONDS
  echo "soak: run $i/$n: scripts/test.sh $* (log: $log)" >&2
  set +e
  scripts/test.sh "$@" >"$log" 2>&1
  rc=$?
  set -e
  # "test <name> ... FAILED" under "Running <binary>" (cargo's output).
  mapfile -t failed < <(awk '
    /^ *Running / { bin = $2 }
    /^test .* \.\.\. FAILED$/ { sub(/^test /, ""); sub(/ \.\.\. FAILED$/, ""); print bin ": " $0 }
  ' "$log")
  [ "$rc" = 0 ] || [ ${#failed[@]} -gt 0 ] || failed=("<run>: scripts/test.sh exited $rc without a failed test (see its log)")
  for t in "${failed[@]}"; do failed_count[$t]=$(( ${failed_count[$t]:-0} + 1 )); done
  mapfile -t left < <(leftovers "$log")
  echo "soak: run $i/$n: exit $rc in $((SECONDS - t0))s; failed: ${#failed[@]}; leftovers: ${#left[@]}"
  for t in "${failed[@]}"; do echo "  FAILED $t"; done
  for x in "${left[@]}"; do echo "  LEFT   $x"; done
  if [ "$rc" != 0 ] || [ ${#failed[@]} -gt 0 ] || [ ${#left[@]} -gt 0 ]; then bad_runs=$((bad_runs + 1)); fi
done

echo "soak: $n runs, $bad_runs with failures or leftovers"
if [ ${#failed_count[@]} -gt 0 ]; then
  echo "soak: failures per test:"
  for t in "${!failed_count[@]}"; do echo "  ${failed_count[$t]}/$n $t"; done | sort -t/ -k1,1nr
fi
[ "$bad_runs" = 0 ]
