#!/usr/bin/env bash
# Admission latency of the clusterip webhook through a real kube-apiserver, side by side:
# COUNT Service creates (default 500, all at once; WORKERS=N: N at a time) with the
# kube-apiserver allocating alone, then with our webhook (release build) assigning the
# addresses — for each backend in BACKENDS (default "etcd ipaddress"), each on a dev cluster
# of its own.
#
#   scripts/bench-webhook.sh
#   COUNT=200 BACKENDS=ipaddress scripts/bench-webhook.sh
#   COUNT=15000 WORKERS=100 scripts/bench-webhook.sh   # upstream's perf test
#                                  (test/integration/servicecidr/perf_test.go), ~15 min
#
# Prints, per backend, the webhook's own answer latency (p50/p99 from its histograms: from
# the body in hand, and from the request's headers; RESULT webhook_mutate_latency_<backend>)
# and the ratio of end-to-end create latency and of the total time with and without it
# (RESULT create_<q>_<backend>, create_total_<backend>), and the CPU seconds each process
# (etcd, kube-apiserver, kube-controller-manager, our controller, the burst client) used in
# each burst (RESULT create_cpu_<backend> phase=alone|webhook).
#
# Like every run: leftovers of killed runs are reaped first, this run and all it starts are in
# a pids cgroup of its own (scripts/lib/run.sh) and under a memory cap (scripts/lib/run-capped.sh,
# BENCH_MEM_MIB, default 4096), and whatever is still running at the end is killed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
COUNT=${COUNT:-500}
export BURST_WORKERS=${WORKERS:-$COUNT}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_capped "${BENCH_MEM_MIB:-4096}" "$@"
run_begin bench-webhook
export CLUSTERIP_PROFILE=release
BACKENDS=${BACKENDS:-${CLUSTERIP_BACKEND:-etcd ipaddress}}
export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(owned_tmpdir bench-webhook)
trap 'scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"; run_end' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cargo build --release --quiet --bin clusterip
burst=$(cargo bench --quiet --bench webhook_burst --no-run --message-format=json 2>/dev/null |
  jq -r 'select(.executable != null and .target.name == "webhook_burst") | .executable' | tail -n 1)
[ -x "$burst" ] || { echo "bench-webhook: webhook_burst bench binary not built" >&2; exit 1; }
get() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" <<<"$2" | head -n 1; }
# CPU seconds (user + system) each control-plane process has used so far, "name=s ..."
# (0 for one not running).
ticks=$(getconf CLK_TCK)
components="etcd kube-apiserver kube-controller-manager clusterip-controller"
cpu() {
  local c pid
  for c in $components; do
    pid=$(cat "$CLUSTERIP_CLUSTER_DIR/$c.pid" 2>/dev/null) && [ -r "/proc/$pid/stat" ] || { printf '%s=0 ' "$c"; continue; }
    # Fields 14 and 15 (utime, stime) counted after the ") " that ends the command name.
    sed 's/.*) //' "/proc/$pid/stat" | awk -v c="$c" -v t="$ticks" '{ printf "%s=%.1f ", c, ($12 + $13) / t }'
  done
}
# The CPU each process used between two cpu() readings, and the burst's own.
cpu_used() {
  local c a b out=""
  for c in $components; do
    a=$(get "$c" "$1"); b=$(get "$c" "$2")
    out+="${c}_s=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.1f", b - a }') "
  done
  echo "$out"
}

for backend in $BACKENDS; do
  export CLUSTERIP_BACKEND=$backend
  scripts/dev-cluster.sh down >/dev/null 2>&1 || true
  scripts/dev-cluster.sh up >/dev/null 2>&1
  # shellcheck source=/dev/null
  . "$CLUSTERIP_CLUSTER_DIR/env"

  # Without the webhook: the kube-apiserver's own allocator alone.
  scripts/dev-cluster.sh stop clusterip-controller >/dev/null 2>&1
  before=$(cpu)
  plain=$(/usr/bin/time -f 'burst_cpu_s=%U+%S' -o "$CLUSTERIP_CLUSTER_DIR/burst.time" "$burst" "$KUBECONFIG" bench-plain "$COUNT") || { echo "bench-webhook: $backend: creates failed with the kube-apiserver alone: $plain" >&2; exit 1; }
  plain_cpu="$(cpu_used "$before" "$(cpu)")$(cat "$CLUSTERIP_CLUSTER_DIR/burst.time")"
  echo "# $backend: kube-apiserver alone:  $plain"
  # With it.
  scripts/dev-cluster.sh start clusterip-controller >/dev/null 2>&1
  # The apiserver picks webhook configurations up asynchronously: wait until a probe Service
  # gets one of our addresses (198.19.0.0/17).
  for _ in $(seq 1 100); do
    ip=$(scripts/kubectl.sh create service clusterip "probe-$RANDOM" --tcp=80 -o jsonpath='{.spec.clusterIP}' 2>/dev/null || true)
    case "$ip" in 198.19.[0-9].*|198.19.[0-9][0-9].*|198.19.1[01][0-9].*|198.19.12[0-7].*) break ;; esac
    sleep 0.2
  done
  before=$(cpu)
  with=$(/usr/bin/time -f 'burst_cpu_s=%U+%S' -o "$CLUSTERIP_CLUSTER_DIR/burst.time" "$burst" "$KUBECONFIG" bench-webhook "$COUNT" "$CLUSTERIP_METRICS_URL/metrics") || { echo "bench-webhook: $backend: creates failed with the webhook: $with" >&2; exit 1; }
  with_cpu="$(cpu_used "$before" "$(cpu)")$(cat "$CLUSTERIP_CLUSTER_DIR/burst.time")"
  echo "# $backend: with clusterip webhook: $(echo "$with" | head -n 1)"
  # Where the time went: each process's CPU during each burst (2 cores: a burst that keeps
  # both busy takes as long as the CPU all of them need).
  echo "RESULT create_cpu_$backend phase=alone $plain_cpu"
  echo "RESULT create_cpu_$backend phase=webhook $with_cpu"
  mp50=$(get webhook_mutate_p50_ms "$with"); mp99=$(get webhook_mutate_p99_ms "$with")
  vp50=$(get webhook_validate_p50_ms "$with"); vp99=$(get webhook_validate_p99_ms "$with")
  echo "RESULT webhook_mutate_latency_$backend p50_ms=$mp50 p99_ms=$mp99 target_p99_ms=2"
  echo "RESULT webhook_validate_latency_$backend p50_ms=$vp50 p99_ms=$vp99 target_p99_ms=2"
  # The same answers timed from the request's headers: adds the wait for the body, which the
  # kube-apiserver sends on its own schedule (on a 2-core machine, while it is saturated).
  echo "RESULT webhook_mutate_request_latency_$backend p50_ms=$(get webhook_mutate_request_p50_ms "$with") p99_ms=$(get webhook_mutate_request_p99_ms "$with")"
  echo "RESULT webhook_validate_request_latency_$backend p50_ms=$(get webhook_validate_request_p50_ms "$with") p99_ms=$(get webhook_validate_request_p99_ms "$with")"
  for q in p50 p99 mean; do
    a=$(get "create_${q}_ms" "$(echo "$with" | head -n 1)"); b=$(get "create_${q}_ms" "$plain")
    echo "RESULT create_${q}_$backend ours_ms=$a kubernetes_ms=$b ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')"
  done
  a=$(get wall_s "$(echo "$with" | head -n 1)"); b=$(get wall_s "$plain")
  echo "RESULT create_total_$backend creates=$COUNT workers=$BURST_WORKERS ours_s=$a kubernetes_s=$b ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')"
done
