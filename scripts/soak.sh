#!/usr/bin/env bash
# Soak: Service create/update/delete churn at a steady rate through the webhook, for each
# backend in turn (etcd, then ipaddress), with the node agent programming the VIPs into a
# network namespace; invariants checked all along; RSS of every component sampled.
#
#   scripts/soak.sh [MINUTES]          MINUTES of churn per backend (default 10)
#   SOAK_REPLICAS=3 scripts/soak.sh [MINUTES]
#                                      three ipaddress-backend replicas instead, behind one
#                                      webhook, under churn (20 creates/s, each Service lives
#                                      7.5 s) while their faults repeat in rounds: a held block
#                                      Lease deleted, a replica frozen 1.5 × D, a replica's path
#                                      to the apiserver black-holed 120 s, one delayed 5 s —
#                                      take-overs and hand-overs throughout. It is the test
#                                      controller_e2e::faults::ipaddress_backend_three_replicas_under_faults
#                                      sized to MINUTES (CLUSTERIP_FAULTS_CREATES = 1200 per
#                                      minute); its RESULT line counts refusals, duplicates,
#                                      take-overs and hand-overs (docs/reliability.md).
#
# The churn soak is the ignored test tests/soak.rs (its module doc says what it does and
# checks): per backend a private control plane with the clusterip controller, the node agent
# programming a network namespace, four probe Services answering all along, Services created,
# updated and deleted at SOAK_RATE per second, the invariants checked every SOAK_CHECK_S
# seconds, `clusterip repair --fix` at the end; RESULT lines (throughput, errors, violations,
# memory start/end/max per component). This script installs what it needs (nftables,
# iproute2, … : scripts/lib/ensure-packages.sh), builds the agent, and runs
#   SOAK_MINUTES=MINUTES cargo test --test soak -- --ignored --nocapture
# Must run as root. Exits 1 on any violation, failed operation or component that cannot work.
#
# Env: SOAK_BACKENDS (default "etcd ipaddress"), SOAK_RATE (10), SOAK_SERVICES (200),
# SOAK_CHECK_S (30), SOAK_SEED (the churn's random seed), SOAK_MEM_MIB (memory cap of the
# whole run, default 6144; 0 = none), CLUSTERIP_PROFILE (debug|release, default debug).
# Logs: target/soak/<date>-<pid>/.
#
# Nothing outlives it (scripts/lib/run.sh): the run is in a pids cgroup of its own (whatever
# is left is killed at the end; a SIGKILLed run is reaped by the next run or
# `scripts/dev-cluster.sh reap`), its clusters are owned by the test process (watchdog), its
# namespaces are cip<pid>x…, and the whole run is under a memory cap (scripts/lib/run-capped.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh

minutes=${1:-10}
[[ $minutes =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [MINUTES]  (a whole number ≥ 1)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "soak: must run as root (network namespaces)" >&2; exit 2; }
run_capped "${SOAK_MEM_MIB:-6144}" "$@"
run_begin soak
trap run_end EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

if [ "${SOAK_REPLICAS:-1}" = 3 ]; then
  logs=$root/target/soak/$(date -u +%Y%m%dT%H%M%S)-$$-replicas
  mkdir -p "$logs"
  echo "soak: three replicas under faults for about $minutes min (log: $logs/faults.log)" >&2
  rc=0
  CLUSTERIP_FAULTS_CREATES=$((minutes * 1200)) CLUSTERIP_FAULTS_BLACKHOLE_S=120 \
    scripts/test.sh --test controller_e2e -- faults:: --nocapture > "$logs/faults.log" 2>&1 || rc=$?
  grep '^RESULT' "$logs/faults.log" || true
  [ "$rc" = 0 ] || { echo "soak: FAILED (exit $rc); see $logs/faults.log" >&2; exit 1; }
  exit 0
elif [ "${SOAK_REPLICAS:-1}" != 1 ]; then
  echo "soak: SOAK_REPLICAS is 1 (the default) or 3" >&2
  exit 2
fi

profile=${CLUSTERIP_PROFILE:-debug}
build=(); [ "$profile" = release ] && build=(--release)
logs=$root/target/soak/$(date -u +%Y%m%dT%H%M%S)-$$
mkdir -p "$logs"
# The agent programs the node through nft; namespaces need ip (iproute2).
[ "${CLUSTERIP_PACKAGES_ENSURED:-}" = 1 ] || scripts/lib/ensure-packages.sh
export CLUSTERIP_PACKAGES_ENSURED=1

# (Long steps run in the background and are waited for, so a TERM ends the run at once.)
echo "soak: building clusterip-agent and the soak test ($profile)" >&2
cargo build -j2 --quiet "${build[@]}" -p clusterip-agent --bin clusterip-agent &
wait $!
rc=0
SOAK_MINUTES=$minutes SOAK_LOG_DIR=$logs CLUSTERIP_AGENT_BIN=$CARGO_TARGET_DIR/$profile/clusterip-agent \
  cargo test -j2 --quiet "${build[@]}" --test soak -- --ignored --nocapture &
wait $! || rc=$?
[ "$rc" = 0 ] || { echo "soak: FAILED (exit $rc); logs in $logs" >&2; exit 1; }
