#!/usr/bin/env bash
# The repair pass with the etcd backend, on a private dev control plane (its own etcd and
# kube-apiserver, service range 198.18.0.0/16). Two measurements (examples/bench_repair.rs):
#
#   1. real: REAL Services (default 5,000) created with static ClusterIPs through the
#      kube-apiserver, the same addresses recorded in the etcd backend, then `clusterip
#      repair` (a dry run: every Service listed 500 at a time, the allocation map read,
#      decided) timed as a process, peak memory from /usr/bin/time (max RSS = VmHWM).
#      Creating 50,000 real Services on this 2-core machine was not feasible in minutes
#      (5,000 took 25 s, 15,000 took 231 s: the apiserver slows as they accumulate).
#   2. synthetic: COUNT (default 50,000) addresses recorded in the real etcd backend, then
#      one pass in-process over COUNT synthetic Services fed as list pages of JSON (500 per
#      page, deserialized as the client does): records read + Services decoded + decide,
#      with VmHWM. What it leaves out is the apiserver's time to serve the list.
# Both passes must find their cluster consistent.
#
#   scripts/bench-repair.sh                      # REAL=5000 COUNT=50000
#   REAL=2000 COUNT=50000 RUNS=3 scripts/bench-repair.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
REAL=${REAL:-5000}
COUNT=${COUNT:-50000}
RUNS=${RUNS:-3}
CIDR=198.18.0.0/16
target=${CARGO_TARGET_DIR:-$repo/target}

export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/clusterip-bench-repair.XXXXXX")
trap 'scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"' EXIT INT TERM

cargo build --release --quiet --bin clusterip --example bench_repair
bin=$target/release/clusterip
helper=$target/release/examples/bench_repair
CLUSTERIP_CONTROLLER=0 CLUSTERIP_APISERVER_SERVICE_CIDRS=$CIDR scripts/dev-cluster.sh up >/dev/null
. "$CLUSTERIP_CLUSTER_DIR/env"

echo "== synthetic: $COUNT Services (list pages decoded in-process) + real etcd records, $RUNS runs"
for i in $(seq "$RUNS"); do
  "$helper" synthetic "$CLUSTERIP_ETCD_ENDPOINTS" "/clusterip-bench/synthetic-$i" "$CIDR" "$COUNT"
done

echo "== real: $REAL Services through the kube-apiserver"
"$helper" seed "$KUBECONFIG" "$CLUSTERIP_ETCD_ENDPOINTS" /clusterip-bench/real "$CIDR" "$REAL" 32
for i in $(seq "$RUNS"); do
  out=$(mktemp)
  set +e
  /usr/bin/time -f 'wall_s=%e max_rss_kb=%M' -o "$out.time" \
    "$bin" repair --backend etcd --etcd-endpoints "$CLUSTERIP_ETCD_ENDPOINTS" --etcd-prefix /clusterip-bench/real \
      --service-cidr "$CIDR" --kubeconfig "$KUBECONFIG" -o json >"$out" 2>"$out.err"
  code=$?
  set -e
  summary=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("services=%d records=%d findings=%d pass_s=%.3f" % (d["services"], d["records"], len(d["findings"]), d["duration_s"]))' "$out" 2>&1 || echo "no report")
  echo "real run $i: exit=$code $(cat "$out.time") $summary"
  [ "$code" = 0 ] || { echo "bench-repair: the pass did not find the seeded cluster consistent" >&2; head -c 2000 "$out" >&2; cat "$out.err" >&2; exit 1; }
  rm -f "$out" "$out.time" "$out.err"
done
