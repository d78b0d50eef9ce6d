#!/usr/bin/env bash
# Issue 30's conntrack fork storm as a figure (agent/benches/tenants.rs): one UDP Service
# with 5,000 externalIPs whose endpoint changes every 10 s, beside 1,000 UDP Services with
# one endpoint change per second, 100k conntrack entries in the node's namespace. Prints
# one line per agent run:
#
#   RESULT tenants … first_sync_s=<> programmed=<> p50_s=<> p99_s=<> within_1s=<>
#          pending_at_end_s=<> syncs=<> conntrack_processes=<> conntrack_processes_per_sync=<>
#          flushed_entries=<> flush_failures=<> stale_entries_left=<> vmhwm_mib=<>
#
# Runs: this build with `--max-service-addresses 0` (the Service's 5,000 externalIPs are
# programmed: the flushes' worst case) at the DaemonSet's --min-sync-period 1s and at
# 100ms, then with the default limit (the Service keeps its ClusterIP only), then, when
# BENCH_AGENT_BEFORE names another agent binary (an older commit's release build), that
# one with no extra flags. Must run as root.
#
# Env: TENANTS_DURATION_S (60), TENANTS_EXTERNAL_IPS (5000), TENANTS_SERVICES (1000),
# TENANTS_PREFILL (100000), TENANTS_FIRST_SYNC_TIMEOUT_S (300), BENCH_MEM_CAP_MIB (4096: each run, apiserver included, in a memory cgroup of its
# own), BENCH_AGENT_BEFORE.
#
# Each run starts a private dev control plane (tests/support) and stops it at its end; its
# network namespaces are cip<pid>x…, its agent dies with it (PR_SET_PDEATHSIG). The script
# is tracked by scripts/lib/run.sh (a pids cgroup; leftovers killed at the end, reaped by
# the next run if this one is SIGKILLed). A few minutes per run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_begin bench-agent-tenants
trap run_end EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cap=${BENCH_MEM_CAP_MIB:-4096}
cargo bench -j2 -p clusterip-agent --bench tenants --no-run >&2
one() { # label, agent binary ("" = this build), extra agent flags, min sync period
  local log rc=0
  mkdir -p "$CARGO_TARGET_DIR/tmp"
  log=$(mktemp "$CARGO_TARGET_DIR/tmp/bench-agent-tenants.XXXXXX.log")
  echo "bench-agent-tenants: run $1" >&2
  TENANTS_AGENT_FLAGS=$3 TENANTS_MIN_SYNC_PERIOD=${4:-1s} \
    scripts/lib/run-capped.sh "$cap" -- env ${2:+CLUSTERIP_AGENT_BIN=$2} \
    cargo bench -j2 -p clusterip-agent --bench tenants >"$log" 2>&1 || rc=$?
  sed -n "s/^RESULT tenants /RESULT tenants run=$1 /p" "$log"
  grep -E '^(tenants|run-capped):' "$log" >&2 || true
  if [ "$rc" != 0 ]; then
    echo "bench-agent-tenants: run $1 failed (rc $rc); its output: $log" >&2
    tail -n 40 "$log" >&2
    return "$rc"
  fi
  rm -f "$log"
}
unset CLUSTERIP_AGENT_BIN
one after-no-limit "" "--max-service-addresses 0"
one after-no-limit-100ms "" "--max-service-addresses 0" 100ms
one after-default-limit "" ""
if [ -n "${BENCH_AGENT_BEFORE:-}" ]; then
  one before "$BENCH_AGENT_BEFORE" ""
fi
