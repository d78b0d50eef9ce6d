#!/usr/bin/env bash
# Side-by-side sync benchmark: clusterip-agent vs kube-proxy, both in nftables mode, both
# fed by the same dev kube-apiserver and objects, each programming a network namespace of
# its own (see agent/benches/nft_sync.rs for the method).
#
#   scripts/bench-agent.sh                      # 1k, 10k, 50k Services x 10 endpoints
#   BENCH_SIZES=1000,10000 scripts/bench-agent.sh
#
# Env:
#   BENCH_SIZES         comma-separated Service counts (default 1000,10000,50000)
#   BENCH_ENDPOINTS     endpoints per Service (default 10)
#   BENCH_CHANGE_AT     size at which one changed Service is timed (default 10000)
#   BENCH_TIMEOUT_S     give up waiting for one full sync after this (default 1800)
#   BENCH_CLUSTER_DIR   reuse a running dev cluster (state dir of scripts/dev-cluster.sh);
#                       default: a private plain cluster, stopped at the end
#   KUBE_PROXY          kube-proxy binary (default: the one built by
#                       scripts/lib/build-go-binaries.sh kube-proxy, if present)
#   BENCH_BUILD_KUBE_PROXY=1  build kube-proxy first when it is missing (slow)
#
# Prints lines "RESULT <workload> ours_s=<> kube_proxy_s=<> ratio=<>" (ratio = kube-proxy / ours)
# and "RESULT peak_memory_<n> ours_mib=<> kube_proxy_mib=<> ratio=<>", then the per-connection
# cost through a VIP with 1 and 10k Services (agent/benches/vip_connect.rs, ours only):
# "RESULT vip_connect_<n>_services median_us=<> p90_us=<> ratio_to_1=<>", and the dataplane
# alone on synthetic Services (agent/benches/synthetic_sync.rs):
# "RESULT synthetic_full_sync_<n>x10 ours_s=<>", "RESULT synthetic_one_change_at_<n> ours_s=<first>
# kernel_s=<> median_s=<>" and "RESULT synthetic_count_change_at_<n> ours_s=<median>".
# Our sync durations come from the agent's "sync done … elapsed_us" log lines. Must run as root.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
sizes=${BENCH_SIZES:-1000,10000,50000}
endpoints=${BENCH_ENDPOINTS:-10}
change_at=${BENCH_CHANGE_AT:-10000}
timeout_s=${BENCH_TIMEOUT_S:-1800}

k8s_bin=$(scripts/lib/build-go-binaries.sh print-dirs | sed -n 's/^K8S_BIN=//p')
kube_proxy=${KUBE_PROXY:-$k8s_bin/kube-proxy}
if [[ ! -x $kube_proxy && ${BENCH_BUILD_KUBE_PROXY:-0} == 1 ]]; then
  scripts/lib/build-go-binaries.sh kube-proxy
fi
if [[ ! -x $kube_proxy ]]; then
  echo "bench-agent: kube-proxy not found at $kube_proxy: measuring clusterip-agent only" >&2
  kube_proxy=""
fi

if [[ -n ${BENCH_CLUSTER_DIR:-} ]]; then
  cluster=$BENCH_CLUSTER_DIR
else
  cluster=$(mktemp -d /tmp/clusterip-bench-cluster.XXXXXX)
  trap 'CLUSTERIP_CLUSTER_DIR=$cluster scripts/dev-cluster.sh down >/dev/null 2>&1 || true' EXIT
  CLUSTERIP_CLUSTER_DIR=$cluster CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >&2
fi

cargo build --release -p clusterip-agent >&2
cargo bench -p clusterip-agent --bench nft_sync -- \
  --kubeconfig "$cluster/kubeconfig" \
  --agent "$CARGO_TARGET_DIR/release/clusterip-agent" \
  --kube-proxy "$kube_proxy" \
  --sizes "$sizes" --endpoints "$endpoints" --change-at "$change_at" --timeout-s "$timeout_s"
cargo bench -p clusterip-agent --bench vip_connect
# The dataplane alone on synthetic Services (no API server): same sizes.
cargo bench -p clusterip-agent --bench synthetic_sync -- "$sizes"
