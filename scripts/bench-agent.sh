#!/usr/bin/env bash
# Side-by-side sync benchmark: clusterip-agent vs kube-proxy, both in nftables mode, both
# fed by the same dev kube-apiserver and objects, each programming a network namespace of
# its own (see agent/benches/nft_sync.rs for the method).
#
#   scripts/bench-agent.sh                      # 1k and 10k Services x 10 endpoints (minutes)
#   BENCH_SIZES=1000,10000,50000 scripts/bench-agent.sh   # 50k: hours on a 2-core machine
#
# Env:
#   BENCH_SIZES         comma-separated Service counts (default 1000,10000)
#   BENCH_ENDPOINTS     endpoints per Service (default 10)
#   BENCH_CHANGE_AT     size at which one changed Service is timed (default 10000)
#   BENCH_TIMEOUT_S     give up waiting for one full sync after this (default 1800)
#   BENCH_MEM_CAP_MIB   memory limit of each proxy (kube-proxy, clusterip-agent), through
#                       scripts/lib/run-capped.sh (default 2048; at 10k Services the cgroups
#                       peak near 520 MiB, kube-proxy, and 340 MiB, clusterip-agent).
#                       Without that script the proxies run uncapped, with a warning.
#   BENCH_CLUSTER_DIR   reuse a running dev cluster (state dir of scripts/dev-cluster.sh);
#                       default: a private plain cluster, stopped at the end
#   KUBE_PROXY          kube-proxy binary (default: the one built by
#                       scripts/lib/build-go-binaries.sh kube-proxy, if present)
#   BENCH_BUILD_KUBE_PROXY=1  build kube-proxy first when it is missing (slow)
#
# kube-proxy runs with --oom-score-adj=0 (its default, -999, would make the kernel kill
# anything else first when memory runs out). Nothing outlives the run: leftovers of killed
# earlier runs are reaped first (scripts/dev-cluster.sh reap, when it has that command),
# the bench's network namespaces are named cip<pid>x…, its children die with it
# (PR_SET_PDEATHSIG), and on exit or INT/TERM this script stops what it started.
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
sizes=${BENCH_SIZES:-1000,10000}
endpoints=${BENCH_ENDPOINTS:-10}
change_at=${BENCH_CHANGE_AT:-10000}
timeout_s=${BENCH_TIMEOUT_S:-1800}
mem_cap_mib=${BENCH_MEM_CAP_MIB:-2048}

# What this run started: a private cluster (state dir) and the process group of the
# running step (each long step runs in a session of its own, so that the whole tree under
# it — cargo, the bench binary, the proxies — can be signalled at once).
cluster_started=""
step_pgid=""
# Remove what killed runs left behind (network namespaces cip<pid>x… whose process is gone,
# …), when scripts/dev-cluster.sh has that command.
reap() {
  if grep -qE '^[[:space:]]*reap\)' scripts/dev-cluster.sh 2>/dev/null; then
    scripts/dev-cluster.sh reap >&2 || echo "bench-agent: scripts/dev-cluster.sh reap failed; continuing" >&2
  fi
}
# Whether process group $1 still has a live (not zombie) member.
group_alive() {
  ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n $step_pgid ]]; then
    kill -TERM -- "-$step_pgid" 2>/dev/null || true
    for _ in $(seq 50); do
      group_alive "$step_pgid" || break
      sleep 0.2
    done
    kill -KILL -- "-$step_pgid" 2>/dev/null || true
    # A bench killed this way could not delete its network namespaces (cip<pid>x…).
    reap
  fi
  if [[ -n $cluster_started ]]; then
    CLUSTERIP_CLUSTER_DIR=$cluster_started scripts/dev-cluster.sh down >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Run "$@" in a session of its own (a new process group) and wait for it.
step() {
  setsid "$@" &
  step_pgid=$!
  local rc=0
  wait "$step_pgid" || rc=$?
  step_pgid=""
  return "$rc"
}

# Leftovers of earlier runs that were killed (namespaces cip<pid>x… of dead processes, …).
reap

capped=()
if [[ -x scripts/lib/run-capped.sh ]]; then
  capped=(--run-capped "$root/scripts/lib/run-capped.sh" --mem-cap-mib "$mem_cap_mib")
else
  echo "bench-agent: WARNING: scripts/lib/run-capped.sh not found: kube-proxy and clusterip-agent run without a memory cap" >&2
fi

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
  cluster_started=$cluster
  # Owned by this script: should it be SIGKILLed, the cluster's watchdog (or the next
  # `reap`) stops the cluster.
  CLUSTERIP_OWNER_PID=$$ CLUSTERIP_CLUSTER_DIR=$cluster CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >&2
fi

step cargo build --release -p clusterip-agent >&2
step cargo bench -p clusterip-agent --bench nft_sync -- \
  --kubeconfig "$cluster/kubeconfig" \
  --agent "$CARGO_TARGET_DIR/release/clusterip-agent" \
  --kube-proxy "$kube_proxy" \
  --sizes "$sizes" --endpoints "$endpoints" --change-at "$change_at" --timeout-s "$timeout_s" \
  "${capped[@]}"
step cargo bench -p clusterip-agent --bench vip_connect
# The dataplane alone on synthetic Services (no API server): same sizes.
step cargo bench -p clusterip-agent --bench synthetic_sync -- "$sizes"
