#!/usr/bin/env bash
# The repair pass over 50,000 Services with the etcd backend, on a private dev control plane
# (its own etcd and kube-apiserver, service range 198.18.0.0/16). Helper:
# examples/bench_repair.rs. Three measurements:
#
#   1. real creates: REAL (default 2,000) Services created through the apiserver with static
#      ClusterIPs, the same addresses recorded in the etcd backend, then `clusterip repair`
#      (a dry run: every Service listed from the real apiserver 500 at a time, the allocation
#      map read, decided) timed as a process; peak memory from /usr/bin/time (max RSS =
#      VmHWM of the process). Creating 50,000 through the API is not feasible here in
#      minutes (10,000 took 142 s, slowing as they accumulate), hence 2.
#   2. real list, 50k: COUNT (default 50,000) more Services written straight into the
#      apiserver's etcd (JSON values it decodes like its own) and recorded in the etcd
#      backend; once the apiserver's own IPAddress repair has caught up (it records every
#      injected Service), the same timed pass over REAL + COUNT + 1 Services.
#   3. synthetic, 50k: COUNT addresses recorded in the real etcd backend; one pass in-process
#      over COUNT synthetic Services fed as list pages of JSON (with managedFields, as the
#      apiserver lists them), with VmHWM; the same pages also decoded as whole Services (how
#      the pass read them before ServiceSummary), timed beside.
#   4. with MILLION=N (e.g. 1000000): part 3 at N Services in an IPv6 /108 (a few minutes
#      per run; BENCH_MEM_MIB=8192).
# Every pass must find its cluster consistent (exit 0).
#
#   scripts/bench-repair.sh                              # COUNT=10000 REAL=1000 RUNS=3 (minutes)
#   COUNT=50000 REAL=2000 scripts/bench-repair.sh        # the documented 50k run (~15 min;
#                                                        # BENCH_MEM_MIB=8192 to be safe)
#   MILLION=1000000 BENCH_MEM_MIB=8192 scripts/bench-repair.sh   # and a pass over a million
#
# Like every run: leftovers of killed runs are reaped first, this run and all it starts are in
# a pids cgroup of its own (scripts/lib/run.sh) and under a memory cap (scripts/lib/run-capped.sh,
# BENCH_MEM_MIB, default 6144), and whatever is still running at the end is killed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
COUNT=${COUNT:-10000}
REAL=${REAL:-1000}
RUNS=${RUNS:-3}
MILLION=${MILLION:-0}
CIDR=198.18.0.0/16
target=${CARGO_TARGET_DIR:-$repo/target}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh
run_capped "${BENCH_MEM_MIB:-6144}" "$@"
run_begin bench-repair

export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(owned_tmpdir bench-repair)
trap 'scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"; run_end' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cargo build --release --quiet --bin clusterip --example bench_repair
bin=$target/release/clusterip
helper=$target/release/examples/bench_repair
CLUSTERIP_CONTROLLER=0 CLUSTERIP_APISERVER_SERVICE_CIDRS=$CIDR scripts/dev-cluster.sh up >/dev/null
# shellcheck source=/dev/null
. "$CLUSTERIP_CLUSTER_DIR/env"

# One timed `clusterip repair` dry run against the etcd prefix $1; fails unless consistent.
pass() {
  local prefix=$1 label=$2 out code summary
  out=$(mktemp)
  set +e
  /usr/bin/time -f 'wall_s=%e max_rss_kb=%M' -o "$out.time" \
    "$bin" repair --backend etcd --etcd-endpoints "$CLUSTERIP_ETCD_ENDPOINTS" --etcd-prefix "$prefix" \
      --service-cidr "$CIDR" --kubeconfig "$KUBECONFIG" -o json >"$out" 2>"$out.err"
  code=$?
  set -e
  summary=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("services=%d records=%d findings=%d pass_s=%.3f" % (d["services"], d["records"], len(d["findings"]), d["duration_s"]))' "$out" 2>&1 || echo "no report")
  echo "$label: exit=$code $(cat "$out.time") $summary"
  [ "$code" = 0 ] || { echo "bench-repair: the pass did not find the cluster consistent" >&2; head -c 2000 "$out" >&2; cat "$out.err" >&2; exit 1; }
  rm -f "$out" "$out.time" "$out.err"
}

echo "== 1. real creates: $REAL Services through the kube-apiserver"
"$helper" seed "$KUBECONFIG" "$CLUSTERIP_ETCD_ENDPOINTS" /clusterip-bench/real "$CIDR" "$REAL" 32
for i in $(seq "$RUNS"); do pass /clusterip-bench/real "real creates run $i"; done

echo "== 2. real list: $COUNT more Services injected into the apiserver's etcd"
"$helper" inject "$CLUSTERIP_ETCD_ENDPOINTS" /clusterip-bench/real "$CIDR" "$COUNT" $((REAL + 1))
# The apiserver's own repair creates an IPAddress per injected Service: measure once it is
# done, so its work does not compete with the pass for the 2 cores (deadline 15 min).
deadline=$((SECONDS + 900))
while :; do
  n=$(scripts/kubectl.sh get ipaddresses --no-headers 2>/dev/null | wc -l)
  [ "$n" -gt $((REAL + COUNT)) ] && break
  [ "$SECONDS" -lt "$deadline" ] || { echo "bench-repair: the apiserver recorded only $n IPAddresses in 15 min; measuring anyway" >&2; break; }
  sleep 10
done
for i in $(seq "$RUNS"); do pass /clusterip-bench/real "real list run $i"; done

echo "== 3. synthetic: $COUNT Services (list pages decoded in-process) + real etcd records"
for i in $(seq "$RUNS"); do
  "$helper" synthetic "$CLUSTERIP_ETCD_ENDPOINTS" "/clusterip-bench/synthetic-$i" "$CIDR" "$COUNT" --compare-whole
done

if [ "$MILLION" != 0 ]; then
  # The pages' Services hold addresses of an IPv6 /108 (2^20 addresses; 198.18.0.0/16 holds
  # 65,536), recorded in the real etcd backend first.
  echo "== 4. synthetic: $MILLION Services in fd00:18:1::/108 (list pages decoded in-process) + real etcd records"
  for i in $(seq "$RUNS"); do
    "$helper" synthetic "$CLUSTERIP_ETCD_ENDPOINTS" "/clusterip-bench/million-$i" fd00:18:1::/108 "$MILLION" $([ "$i" = 1 ] && echo --compare-whole)
  done
fi
