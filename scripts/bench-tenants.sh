#!/usr/bin/env bash
# The figures of docs/reliability.md "Tenants": a hostile tenant against the controller on a
# dev cluster of this run's own (release build, webhook registered, backend
# CLUSTERIP_BACKEND, default etcd).
#
#   scripts/bench-tenants.sh                 both scenarios, 5 minutes each
#   SECONDS_PER=600 scripts/bench-tenants.sh pinning
#
# probes:  64 keep-alive connections to the metrics and to the health-probe port, a request
#          every 5 s each, plus 100 new silent TCP connections a second to the webhook port;
#          meanwhile probes once a second (2 s deadline) and one Service create a second.
#          Targets: 0 failed probes, 0 controller restarts, >= 99% of creates succeed.
# pinning: on a /24 of the controller's own, 5 creates a second that the apiserver refuses
#          after our answer (port 0) while another namespace creates one valid Service a
#          second (each deleted 10 s later). Target: 0 valid creates refused "range is full".
#
# Like every run: leftovers of killed runs are reaped first, this run and all it starts are
# in a pids cgroup of its own under a memory cap (BENCH_MEM_MIB, default 4096), and what is
# still running at the end is killed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_capped "${BENCH_MEM_MIB:-4096}" "$@"
run_begin bench-tenants
export CLUSTERIP_PROFILE=release
secs=${SECONDS_PER:-300}
scenarios=${*:-probes pinning}
export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(owned_tmpdir bench-tenants)
trap 'scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"; run_end' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cargo build --release --quiet --bin clusterip
bench=$(cargo bench --quiet --bench tenants --no-run --message-format=json 2>/dev/null |
  jq -r 'select(.executable != null and .target.name == "tenants") | .executable' | tail -n 1)
[ -x "$bench" ] || { echo "bench-tenants: tenants bench binary not built" >&2; exit 1; }

for scenario in $scenarios; do
  case $scenario in
    # (pinning: a /24 of the controller's own, inside the apiserver's 198.19.0.0/16)
    pinning) export CLUSTERIP_SERVICE_CIDRS=198.19.200.0/24 ;;
    probes) unset CLUSTERIP_SERVICE_CIDRS ;;
    *) echo "bench-tenants: unknown scenario $scenario (probes, pinning)" >&2; exit 2 ;;
  esac
  scripts/dev-cluster.sh down >/dev/null 2>&1 || true
  scripts/dev-cluster.sh up >/dev/null 2>&1
  # shellcheck source=/dev/null
  . "$CLUSTERIP_CLUSTER_DIR/ports.env"
  pid=$(cat "$CLUSTERIP_CLUSTER_DIR/clusterip-controller.pid")
  kubeconfig=$CLUSTERIP_CLUSTER_DIR/kubeconfig
  # The apiserver picks webhook configurations up asynchronously: wait until a probe Service
  # gets one of the controller's addresses.
  case $scenario in pinning) ours='^198\.19\.200\.' ;; *) ours='^198\.19\.([0-9]|[0-9][0-9]|1[01][0-9]|12[0-7])\.' ;; esac
  for _ in $(seq 1 100); do
    ip=$(scripts/kubectl.sh --kubeconfig "$kubeconfig" create service clusterip "probe-$RANDOM" --tcp=80 -o jsonpath='{.spec.clusterIP}' 2>/dev/null || true)
    [[ $ip =~ $ours ]] && break
    sleep 0.2
  done
  case $scenario in
    probes) "$bench" probes "$kubeconfig" "$CONTROLLER_HEALTH_PORT" "$CONTROLLER_METRICS_PORT" "$WEBHOOK_PORT" "$secs" ;;
    pinning) "$bench" pinning "$kubeconfig" "$CONTROLLER_METRICS_PORT" "$secs" ;;
  esac
  now=$(cat "$CLUSTERIP_CLUSTER_DIR/clusterip-controller.pid")
  restarts=0; [ "$now" = "$pid" ] && kill -0 "$pid" 2>/dev/null || restarts=1
  echo "RESULT tenant_${scenario}_controller restarts=$restarts target=0"
done
