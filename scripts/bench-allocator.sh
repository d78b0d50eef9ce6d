#!/usr/bin/env bash
# Allocator core, side by side with Kubernetes' own bitmap allocator on the same workloads:
#   (a) fill a /12 from empty to full with allocate_next         (ns per allocation)
#   (b) churn at 99% fill on a /16: release a random held address, allocate_next
#                                                                 (ns per pair)
#   (c) allocate_next + release on a /64 holding 1M addresses     (ours only: the bitmap
#       allocator cannot hold a /64)
# Ours: criterion (benches/allocator.rs). Kubernetes': benches/k8s-ipallocator/main.go,
# built against k8s.io/kubernetes/pkg/registry/core/service/ipallocator at the pinned
# version (scripts/versions.env) in the harness's cached Go module.
#
# Prints: RESULT <workload> ours_ns_per_op=<x> kubernetes_ns_per_op=<y> ratio=<y/x>
#         RESULT worst_ratio=<min ratio>
#
# Like every run: leftovers of killed runs are reaped first, this run and all it starts are in
# a pids cgroup of its own (scripts/lib/run.sh) and under a memory cap (scripts/lib/run-capped.sh,
# BENCH_MEM_MIB, default 4096), and whatever is still running at the end is killed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_capped "${BENCH_MEM_MIB:-4096}" "$@"
run_begin bench-allocator
trap run_end EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Kubernetes' side: the Go program built inside the harness's wrapper module (it pins every
# k8s.io staging module), under the cache's build lock (build-go-binaries.sh).
scripts/lib/build-go-binaries.sh ipallocbench
gobench="$(scripts/lib/build-go-binaries.sh print-dirs | sed -n 's/^K8S_BIN=//p')/ipallocbench"

echo "bench-allocator: Kubernetes' bitmap allocator" >&2
k8s_out=$("$gobench")
echo "$k8s_out" >&2

echo "bench-allocator: ours (criterion)" >&2
cargo bench --bench allocator -- --noplot 2>&1 | grep -E '^(INFO|allocator/)|time:' >&2

ours() { jq -r '.mean.point_estimate' "target/criterion/allocator_$1/new/estimates.json"; }
theirs() { echo "$k8s_out" | sed -n "s/^$1 ns_per_op=\([0-9.]*\).*/\1/p"; }

worst=""
for w in fill_slash12 churn_99pct_slash16; do
  o=$(ours "$w"); k=$(theirs "$w")
  r=$(awk -v k="$k" -v o="$o" 'BEGIN { printf "%.1f", k / o }')
  printf 'RESULT %s ours_ns_per_op=%.1f kubernetes_ns_per_op=%.1f ratio=%s\n' "$w" "$o" "$k" "$r"
  worst=$(awk -v a="${worst:-$r}" -v b="$r" 'BEGIN { print (b < a ? b : a) }')
done
printf 'RESULT next_slash64_1m ours_ns_per_op=%.1f kubernetes_ns_per_op=n/a ratio=n/a\n' "$(ours next_slash64_1m)"
echo "RESULT worst_ratio=$worst"
