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
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=versions.env
. scripts/versions.env
cache_root=${CLUSTERIP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/clusterip}
k8s_dir="$cache_root/kubernetes-v$K8S_VERSION"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

# Kubernetes' side: build the Go program inside the harness's wrapper module (created on
# first use by build-go-binaries.sh; it pins every k8s.io staging module).
scripts/lib/build-go-binaries.sh k8s-module >/dev/null
gobench="$k8s_dir/bin/ipallocbench"
if [ ! -x "$gobench" ] || [ benches/k8s-ipallocator/main.go -nt "$gobench" ]; then
  mkdir -p "$k8s_dir/src/cmd/ipallocbench" "$k8s_dir/bin"
  cp benches/k8s-ipallocator/main.go "$k8s_dir/src/cmd/ipallocbench/main.go"
  echo "bench-allocator: building Kubernetes' ipallocator benchmark (v$K8S_VERSION)" >&2
  (cd "$k8s_dir/src" && go build -trimpath -o "$gobench" ./cmd/ipallocbench)
fi

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
