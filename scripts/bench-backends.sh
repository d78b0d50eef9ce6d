#!/usr/bin/env bash
# Allocation throughput of the backends, side by side, on a private dev control plane:
#   (a) etcd with group commit (our default), (b) etcd with one compare-and-swap per
#   allocation (the same code, --etcd-max-batch 1: Kubernetes' strategy), (c) IPAddress
#   objects through the real kube-apiserver.
# Each run is one `clusterip allocate` process with C concurrent callers.
#
#   scripts/bench-backends.sh            # COUNT=2000 allocations per run (minutes)
#   COUNT=500 scripts/bench-backends.sh
#
# Like every run: leftovers of killed runs are reaped first, this run and all it starts are in
# a pids cgroup of its own (scripts/lib/run.sh) and under a memory cap (scripts/lib/run-capped.sh,
# BENCH_MEM_MIB, default 4096), and whatever is still running at the end is killed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
COUNT=${COUNT:-2000}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_capped "${BENCH_MEM_MIB:-4096}" "$@"
run_begin bench-backends

export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(owned_tmpdir bench)
trap 'scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"; run_end' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cargo build --release --quiet --bin clusterip
bin=$repo/target/release/clusterip
CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >/dev/null
# shellcheck source=/dev/null
. "$CLUSTERIP_CLUSTER_DIR/env"

run=0
# ops/s of one run: allocate COUNT addresses from a fresh range (an IPv6 /112 per run,
# 65535 usable, so no run fills its range) with C callers.
measure() {
  local c=$1; shift
  run=$((run + 1))
  local cidr="fd00:b:$run::/112"
  local summary
  summary=$(RUST_LOG=warn "$bin" allocate --service-cidr "$cidr" --count "$COUNT" --concurrency "$c" "$@" 2>&1 >/dev/null | grep '^allocated=' | tail -n 1)
  local failed; failed=$(sed -n 's/.*failed=\([0-9]*\).*/\1/p' <<<"$summary")
  [ "${failed:-1}" = 0 ] || { echo "bench-backends: run failed: $summary" >&2; exit 1; }
  sed -n 's/.*ops_per_s=\([0-9.]*\).*/\1/p' <<<"$summary"
}

etcd=(--backend etcd --etcd-endpoints "$CLUSTERIP_ETCD_ENDPOINTS")
ipaddr=(--backend ipaddress --kubeconfig "$KUBECONFIG")
for c in 1 8 64; do
  group=$(measure "$c" "${etcd[@]}" --etcd-prefix "/bench/group-$c")
  single=$(measure "$c" "${etcd[@]}" --etcd-prefix "/bench/single-$c" --etcd-max-batch 1)
  ratio=$(awk -v a="$group" -v b="$single" 'BEGIN { printf "%.2f", a / b }')
  echo "RESULT etcd_group_commit_vs_single_cas_$c ours=$group baseline=$single ratio=$ratio"
  ipa=$(measure "$c" "${ipaddr[@]}")
  ratio=$(awk -v a="$ipa" -v b="$single" 'BEGIN { printf "%.2f", a / b }')
  echo "RESULT ipaddress_objects_vs_single_cas_$c ours=$ipa baseline=$single ratio=$ratio"
done
