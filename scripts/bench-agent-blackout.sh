#!/usr/bin/env bash
# No VIP blackout at scale: agent/tests/no_blackout.rs (nftables test) at 10k Services.
# A client namespace connects continuously to 4 VIPs while a failed sync forces a full
# rebuild and while the agent is SIGKILLed and started again; prints the test's figures:
#
#   RESULT blackout_load services=<n> seconds=<>          writing the objects to the apiserver
#   RESULT blackout services=<n> max_ops=<> connections_ok=<> connections_failed=<>
#          rebuild_ms=<> restart_first_sync_ms=<> restart_kill_to_synced_s=<>
#
# and fails when a connection failed. Must run as root (network namespaces).
#
# Env:
#   BLACKOUT_SERVICES   Services (default 10000; 4 with real backends, the rest 10
#                       unreachable endpoints each)
#   BLACKOUT_MAX_OPS    the agent's --max-ops-per-transaction (default 50000, its default:
#                       at 10k Services x 10 endpoints a rebuild is ~130 000 operations)
#
# A private dev control plane is started by the test (tests/support) and stopped at its end;
# its namespaces are cip<pid>x…, its processes die with it (PR_SET_PDEATHSIG). The run is
# tracked by scripts/lib/run.sh (a pids cgroup; leftovers killed at the end, reaped by the
# next run if this one is SIGKILLed).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_begin bench-agent-blackout
trap run_end EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log=$(mktemp /tmp/bench-agent-blackout.XXXXXX.log)
rc=0
CLUSTERIP_BLACKOUT_SERVICES=${BLACKOUT_SERVICES:-10000} \
CLUSTERIP_BLACKOUT_MAX_OPS=${BLACKOUT_MAX_OPS:-50000} \
  cargo test -j2 -p clusterip-agent --test no_blackout -- --nocapture --exact \
  vips_keep_answering_through_a_forced_rebuild_and_an_agent_restart >"$log" 2>&1 || rc=$?
grep '^RESULT' "$log" || true
if [ "$rc" != 0 ]; then
  echo "bench-agent-blackout: the test failed (rc $rc); its output: $log" >&2
  tail -n 40 "$log" >&2
  exit "$rc"
fi
rm -f "$log"
