#!/usr/bin/env bash
# Allocation throughput of the backends, side by side, on a private dev control plane:
#   (a) etcd with group commit (our default), (b) etcd with one compare-and-swap per
#   allocation (the same code, --etcd-max-batch 1: the bitmap allocator's strategy), (c)
#   IPAddress objects through the real kube-apiserver, and (d) Kubernetes' own IPAddress
#   allocator (ipallocator.NewIPAllocator, the default since 1.33: benches/k8s-ipallocator,
#   built from Go modules), against the same apiserver.
# Each run is one process with C concurrent callers (`clusterip allocate`, or the Go program
# with one allocator shared by its callers, as a kube-apiserver's requests share it).
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
scripts/lib/build-go-binaries.sh ipallocbench
gobench="$(scripts/lib/build-go-binaries.sh print-dirs | sed -n 's/^K8S_BIN=//p')/ipallocbench"
CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >/dev/null
# shellcheck source=/dev/null
. "$CLUSTERIP_CLUSTER_DIR/env"

# Each run allocates from a range of its own, an IPv6 /112 (65535 usable, so no run fills
# it): fd00:b:<n>::/112 for run n (counted here, not in the measuring subshells).
run=0
next_range() { run=$((run + 1)); }
range() { echo "fd00:b:$run::/112"; }

# ops/s of one `clusterip allocate` run: COUNT addresses from this run's range, C callers.
measure() {
  local c=$1; shift
  local summary
  summary=$(RUST_LOG=warn "$bin" allocate --service-cidr "$(range)" --count "$COUNT" --concurrency "$c" "$@" 2>&1 >/dev/null | grep '^allocated=' | tail -n 1)
  local failed; failed=$(sed -n 's/.*failed=\([0-9]*\).*/\1/p' <<<"$summary")
  [ "${failed:-1}" = 0 ] || { echo "bench-backends: run failed: $summary" >&2; exit 1; }
  sed -n 's/.*ops_per_s=\([0-9.]*\).*/\1/p' <<<"$summary"
}

# ops/s of Kubernetes' IPAddress allocator: COUNT allocations from this run's range, C callers.
measure_k8s() {
  local c=$1
  local summary failed
  local err="$CLUSTERIP_CLUSTER_DIR/ipallocbench-$run.err"
  summary=$("$gobench" -kubeconfig "$KUBECONFIG" -cidr "$(range)" -count "$COUNT" -concurrency "$c" 2>"$err" | grep '^ipaddress_allocator ' | tail -n 1) || true
  failed=$(sed -n 's/.*failed=\([0-9]*\).*/\1/p' <<<"$summary")
  [ "${failed:-1}" = 0 ] || { echo "bench-backends: Kubernetes' IPAddress allocator run failed: ${summary:-no summary}; $(tail -n 3 "$err")" >&2; exit 1; }
  sed -n 's/.*ops_per_s=\([0-9.]*\).*/\1/p' <<<"$summary"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# Delete the IPAddress objects of this run's range (the Go program, 64 deletes at a time):
# each IPAddress run then meets the same cluster (the IPAddress allocator counts every
# object its informer holds at each allocation, so objects left by earlier runs would slow
# the later ones).
clear_run() {
  "$gobench" -kubeconfig "$KUBECONFIG" -cidr "$(range)" -clear >/dev/null
}

etcd=(--backend etcd --etcd-endpoints "$CLUSTERIP_ETCD_ENDPOINTS")
ipaddr=(--backend ipaddress --kubeconfig "$KUBECONFIG")
for c in 1 8 64; do
  next_range
  group=$(measure "$c" "${etcd[@]}" --etcd-prefix "/bench/group-$c")
  single=$(measure "$c" "${etcd[@]}" --etcd-prefix "/bench/single-$c" --etcd-max-batch 1)
  echo "RESULT etcd_group_commit_vs_single_cas_$c ours=$group baseline=$single ratio=$(ratio "$group" "$single")"
  next_range
  ipa=$(measure "$c" "${ipaddr[@]}")
  clear_run
  echo "RESULT ipaddress_objects_vs_single_cas_$c ours=$ipa baseline=$single ratio=$(ratio "$ipa" "$single")"
  next_range
  k8s=$(measure_k8s "$c")
  clear_run
  echo "RESULT etcd_group_commit_vs_k8s_ipaddress_allocator_$c ours=$group peer=$k8s ratio=$(ratio "$group" "$k8s")"
  echo "RESULT ipaddress_objects_vs_k8s_ipaddress_allocator_$c ours=$ipa peer=$k8s ratio=$(ratio "$ipa" "$k8s")"
done
