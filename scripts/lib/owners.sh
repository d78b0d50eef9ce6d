# shellcheck shell=bash
# Owners, runs and reaping: sourced by scripts/dev-cluster.sh, scripts/lib/run.sh,
# scripts/lib/run-capped.sh and scripts/test-soak.sh (see docs/development.md, "Nothing a
# run starts outlives it").
#
# An owner is a process named by its pid and its start time (field 22 of /proc/<pid>/stat,
# clock ticks since boot), so a pid the kernel hands out again is not mistaken for it. It is
# written "<pid> <start>" (an `owner` file) or "<pid>-<start>" (a cgroup name). An owner is
# gone when no process has that pid and start time, or when it is a zombie.
#
# What carries an owner, and what `reap` does once the owner is gone:
#   pids cgroup  <cur>/clusterip/run-<pid>-<start>   a run (test.sh, a bench, test-soak) and
#                 (nested runs: .../run-<a>/run-<b>)  everything it started: killed, removed
#   memory cgroup <cur>/clusterip-cap-<pid>-<start>   one scripts/lib/run-capped.sh: its tasks
#                                                     killed, removed
#   cluster       <state dir>/owner                   scripts/dev-cluster.sh down
#   netns         /run/netns/cip<pid>x<anything>      processes inside killed, deleted (pid
#                                                     only: the creating process)
#   data dir      $TMPDIR/clusterip-*/owner           removed
# (<cur> is the cgroup the creating process was in: ours are always children of it.)

CGROUP_PIDS_ROOT=${CGROUP_PIDS_ROOT:-/sys/fs/cgroup/pids}
CGROUP_MEMORY_ROOT=${CGROUP_MEMORY_ROOT:-/sys/fs/cgroup/memory}

# The start time of a live (non-zombie) process, on stdout; fails when there is none.
proc_start() {
  local stat rest f
  [[ ${1:-} =~ ^[0-9]+$ ]] || return 1
  { read -r stat < "/proc/$1/stat"; } 2>/dev/null || return 1
  # Field 2 (comm) is in parentheses and may hold spaces or ')': cut after the last ') '.
  rest=${stat##*) }
  read -r -a f <<< "$rest"
  # f[0] is field 3 (state), f[19] field 22 (starttime).
  case "${f[0]:-}" in Z|X|x|'') return 1 ;; esac
  echo "${f[19]}"
}

# owner_alive PID START: that very process still runs.
owner_alive() {
  local s
  s=$(proc_start "$1") || return 1
  [ "$s" = "$2" ]
}

# pid_alive PID: some live process has this pid (for names that carry the pid only).
pid_alive() { proc_start "$1" >/dev/null; }

# The owner written for this shell or for $1: "<pid> <start>".
owner_of() {
  local pid=${1:-$$} s
  s=$(proc_start "$pid") || return 1
  echo "$pid $s"
}

# owner_file_alive FILE: the owner named in FILE ("<pid> <start>") still runs. A missing or
# unreadable file counts as alive (no owner: never reaped).
owner_file_alive() {
  local pid start
  [ -f "$1" ] || return 0
  read -r pid start < "$1" 2>/dev/null || return 0
  [[ $pid =~ ^[0-9]+$ && $start =~ ^[0-9]+$ ]] || return 0
  owner_alive "$pid" "$start"
}

# The path of process $2's (default: this shell's) cgroup in the v1 hierarchy of controller $1.
cgroup_of() {
  local want=$1 pid=${2:-$$} ctrls path
  while IFS=: read -r _ ctrls path; do
    [[ ",$ctrls," == *",$want,"* ]] && { echo "$path"; return 0; }
  done < "/proc/$pid/cgroup"
  return 1
}

# One line describing a process, for what reap and run_end print.
proc_desc() {
  local args
  args=$(tr '\0' ' ' 2>/dev/null < "/proc/$1/cmdline" | cut -c1-120) || true
  [ -n "$args" ] || args="[$(cat "/proc/$1/comm" 2>/dev/null || echo gone)]"
  echo "$1 ${args% }"
}

# Every task of a cgroup directory and of its descendants (pids, one a line).
cgroup_tree_procs() {
  local f
  while IFS= read -r f; do cat "$f" 2>/dev/null || true; done < <(find "$1" -name cgroup.procs 2>/dev/null)
}

# kill_cgroup_tree DIR PREFIX: no more forks in DIR (pids controller: pids.max=0), SIGKILL
# every task in it and below until none is left (deadline 30 s), then remove the directories,
# deepest first. Prints "PREFIX killed <pid> <args>" per process. Fails when tasks survive.
kill_cgroup_tree() {
  local dir=$1 prefix=$2 deadline=$((SECONDS + 30)) pid seen=" " left f
  while IFS= read -r f; do echo 0 > "$f" 2>/dev/null || true; done < <(find "$dir" -name pids.max 2>/dev/null)
  while :; do
    left=0
    while read -r pid; do
      [ -n "$pid" ] || continue
      [ "$pid" = "$$" ] && continue
      left=1
      if [[ $seen != *" $pid "* ]]; then
        echo "$prefix killed $(proc_desc "$pid")"
        seen+="$pid "
      fi
      kill -KILL "$pid" 2>/dev/null || true
    done < <(cgroup_tree_procs "$dir")
    [ $left = 0 ] && break
    if [ $SECONDS -ge $deadline ]; then
      echo "$prefix could not empty $dir in 30s: $(cgroup_tree_procs "$dir" | tr '\n' ' ')" >&2
      return 1
    fi
    sleep 0.1
  done
  find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
  [ ! -d "$dir" ] || { echo "$prefix could not remove $dir" >&2; return 1; }
}

# ---------------------------------------------------------------- runs (pids cgroups)
# run_cgroup_enter: put this shell (and so everything it starts from now on) into a pids
# cgroup of its own, named after it: a child of a run cgroup it already is in (a run inside
# a run), or <current>/clusterip/run-<pid>-<start>. Exports CLUSTERIP_RUN_CGROUP.
# Fails (with a message) when the pids hierarchy is missing or not writable.
run_cgroup_enter() {
  local cur parent cg start
  [ -w "$CGROUP_PIDS_ROOT/cgroup.procs" ] || { echo "run: $CGROUP_PIDS_ROOT is not a writable cgroup v1 pids hierarchy; processes of this run are not tracked" >&2; return 1; }
  cur=$(cgroup_of pids) || { echo "run: no pids cgroup in /proc/$$/cgroup" >&2; return 1; }
  cur=${cur%/}
  if [[ $cur == */clusterip/* && ${cur##*/} == run-* ]]; then
    parent=$CGROUP_PIDS_ROOT$cur
  else
    parent=$CGROUP_PIDS_ROOT$cur/clusterip
    mkdir -p "$parent"
  fi
  start=$(proc_start $$)
  cg=$parent/run-$$-$start
  mkdir "$cg"
  echo $$ > "$cg/cgroup.procs"
  export CLUSTERIP_RUN_CGROUP=$cg
}

# run_cgroup_leave PREFIX: move this shell back to the parent cgroup, kill whatever is still
# in the run's cgroup (printing each as a leftover) and remove it.
run_cgroup_leave() {
  local cg=${CLUSTERIP_RUN_CGROUP:-} prefix=$1
  [ -n "$cg" ] && [ -d "$cg" ] || return 0
  echo $$ > "${cg%/*}/cgroup.procs"
  disown -a 2>/dev/null || true   # (no "Killed" job notices from this shell)
  kill_cgroup_tree "$cg" "$prefix leftover process" >&2
}

# ---------------------------------------------------------------- reaping (all but clusters)
# A cgroup name "<prefix><pid>-<start>" -> "pid start".
name_owner() {
  local rest=${1#"$2"}
  [[ $rest =~ ^([0-9]+)-([0-9]+)$ ]] || return 1
  echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"
}

# True when this shell runs inside cgroup directory $1 (or below it).
self_inside() {
  local mine
  mine=$CGROUP_PIDS_ROOT$(cgroup_of pids 2>/dev/null || echo /nonexistent)
  [[ ${mine%/}/ == "${1%/}/"* ]]
}

# Runs whose owner is gone: every task killed, the cgroups removed. A live run is searched
# for dead runs nested inside it.
reap_run_dir() {
  local dir=$1 pid start child
  read -r pid start < <(name_owner "${dir##*/}" run-) || return 0
  if owner_alive "$pid" "$start"; then
    for child in "$dir"/run-*; do [ -d "$child" ] && reap_run_dir "$child"; done
    return 0
  fi
  if self_inside "$dir"; then
    echo "reap: run ${dir##*/} is gone but this reap runs inside it; left for a reap from outside" >&2
    return 0
  fi
  kill_cgroup_tree "$dir" "reap: run ${dir##*/}:" || return 1
  echo "reap: removed cgroup $dir (owner $pid gone)"
}

reap_runs() {
  local top dir rc=0
  [ -d "$CGROUP_PIDS_ROOT" ] || return 0
  while IFS= read -r top; do
    for dir in "$top"/run-*; do
      [ -d "$dir" ] || continue
      reap_run_dir "$dir" || rc=1
    done
  done < <(find "$CGROUP_PIDS_ROOT" -type d -name clusterip 2>/dev/null)
  return $rc
}

# Memory caps (run-capped.sh) whose run-capped is gone: tasks killed, cgroup removed.
reap_caps() {
  local dir pid start deadline rc=0 p seen procs
  [ -d "$CGROUP_MEMORY_ROOT" ] || return 0
  while IFS= read -r dir; do
    read -r pid start < <(name_owner "${dir##*/}" clusterip-cap-) || continue
    owner_alive "$pid" "$start" && continue
    [ -d "$dir" ] || continue
    deadline=$((SECONDS + 30)) seen=" "
    # (cgroup files have no size: read them to see whether tasks are left.)
    while procs=$(grep -vx "$$" "$dir/cgroup.procs" 2>/dev/null) && [ -n "$procs" ]; do
      for p in $procs; do
        [[ $seen == *" $p "* ]] || { echo "reap: memory cap ${dir##*/}: killed $(proc_desc "$p")"; seen+="$p "; }
        kill -KILL "$p" 2>/dev/null || true
      done
      [ $SECONDS -lt $deadline ] || { echo "reap: could not empty $dir in 30s" >&2; rc=1; continue 2; }
      sleep 0.1
    done
    if rmdir "$dir" 2>/dev/null; then echo "reap: removed memory cgroup $dir (owner $pid gone)"
    else echo "reap: could not remove $dir" >&2; rc=1; fi
  done < <(find "$CGROUP_MEMORY_ROOT" -depth -type d -name 'clusterip-cap-*' 2>/dev/null)
  return $rc
}

# Network namespaces cip<pid>x* whose creating process is gone: processes inside killed,
# namespace deleted.
reap_netns() {
  local f name pid p deadline rc=0
  for f in /run/netns/cip*; do
    [ -e "$f" ] || continue
    name=${f##*/}
    [[ $name =~ ^cip([0-9]+)x ]] || continue
    pid=${BASH_REMATCH[1]}
    pid_alive "$pid" && continue
    deadline=$((SECONDS + 30))
    while :; do
      p=$(ip netns pids "$name" 2>/dev/null | grep -vx "$$" || true)
      [ -n "$p" ] || break
      for p in $p; do
        echo "reap: netns $name: killed $(proc_desc "$p")"
        kill -KILL "$p" 2>/dev/null || true
      done
      [ $SECONDS -lt $deadline ] || { echo "reap: processes in netns $name survive SIGKILL" >&2; rc=1; break; }
      sleep 0.1
    done
    if ip netns delete "$name" 2>/dev/null || [ ! -e "$f" ]; then echo "reap: removed netns $name (pid $pid gone)"
    else echo "reap: could not delete netns $name" >&2; rc=1; fi
  done
  return $rc
}

# The directories data dirs and clusters live in (TMPDIR and /tmp).
tmp_roots() {
  local t=${TMPDIR:-/tmp}
  t=${t%/}
  echo "$t"
  [ "$t" = /tmp ] || echo /tmp
}

# Data directories clusterip-* (TMPDIR, /tmp) whose owner file names a process that is gone.
reap_dirs() {
  local root d pid start
  while IFS= read -r root; do
    for d in "$root"/clusterip-*/; do
      d=${d%/}
      [ -f "$d/owner" ] || continue
      owner_file_alive "$d/owner" && continue
      read -r pid start < "$d/owner" || true
      rm -rf "$d"
      echo "reap: removed dir $d (owner $pid gone)"
    done
  done < <(tmp_roots)
}

# mktemp -d under TMPDIR named clusterip-<tag>.XXXXXX with an owner file: CLUSTERIP_OWNER_PID
# when set, else this shell. Prints the path.
owned_tmpdir() {
  local d
  d=$(mktemp -d "${TMPDIR:-/tmp}/clusterip-$1.XXXXXX")
  owner_of "${CLUSTERIP_OWNER_PID:-$$}" > "$d/owner"
  echo "$d"
}
