#!/usr/bin/env bash
# Kubernetes' own e2e tests (e2e.test v<K8S_VERSION>, the release the nodes run) against the
# node cluster of scripts/node-cluster.sh, in one of two configurations, with the same binary
# on the same nodes:
#
#   --proxy kube-proxy   stock: kube-proxy v<K8S_VERSION> in nftables mode, as a DaemonSet
#                        (tests/node/kube-proxy.yaml), the kube-apiserver's own ClusterIP
#                        allocator, no clusterip
#   --proxy clusterip    clusterip deployed as a user does (`kubectl apply -k deploy/`): the
#                        webhook/controller allocates, clusterip-agent is the proxy
#                        (--backend ipaddress, the default, or etcd: the node's etcd, which
#                        then serves the pods too — CLUSTERIP_NODE_BACKEND of node-cluster.sh)
#
#   scripts/conformance.sh [--proxy kube-proxy|clusterip] [--backend ipaddress|etcd]
#                          [--set proxy|conformance|smoke] [--focus REGEX] [--skip REGEX]
#                          [--nodes 1|2|3] [--procs N] [--timeout MIN]
#
#   --set proxy        (default) every test of the selection a Service proxy and allocator
#                      must pass: `[sig-network]` Services, Service CIDRs, ServiceCIDR and
#                      IPAddress API, Networking Granular Checks: Services, Conntrack,
#                      EndpointSlice and EndpointSliceMirroring
#   --set conformance  only the [Conformance] tests of that selection
#   --set smoke        four tests of one node, a few minutes (CI): a basic endpoint, a
#                      NodePort, ClusterIP session affinity, the IPAddress API
#   --focus/--skip     replace the set's regular expressions (ginkgo's --focus/--skip)
#   --nodes 1|2|3      schedulable nodes (default 2: clusterip-node and the worker
#                      clusterip-node-2, CLUSTERIP_NODE_WORKERS=1 of node-cluster.sh; many
#                      Service tests need two and skip themselves on one; 3 adds
#                      clusterip-node-3, CLUSTERIP_NODE_WORKERS=2, for the one test that
#                      needs three: "should implement NodePort and HealthCheckNodePort
#                      correctly when ExternalTrafficPolicy changes"; its figures in
#                      docs/conformance.md "Results (three nodes)" come from
#                      scripts/conformance.sh --proxy kube-proxy|clusterip --nodes 3 --focus
#                      "should implement NodePort and HealthCheckNodePort correctly when
#                      ExternalTrafficPolicy changes" --timeout 20)
#   --procs N          ginkgo processes running specs at once (default 3; the specs mostly
#                      wait on pods, so more than the 2 cores help)
#
# Builds what is missing (e2e.test and the Kubernetes parts: scripts/lib/build-go-binaries.sh;
# the clusterip or kube-proxy images: scripts/build-images.sh; the suite's images and
# CoreDNS: scripts/lib/build-e2e-images.sh), brings nodes of its own up
# (scripts/node-cluster.sh, state in $TMPDIR/cipnode-conformance-<pid>, owned by this run),
# loads the suite's images, deploys clusterip (clusterip only), then CoreDNS as the cluster
# DNS (`node-cluster.sh dns`: the suite reaches Services by name), runs the suite through
# the ginkgo CLI inside the first node's network namespace (the kube-apiserver is reachable
# only there) bounded by --timeout minutes (default 60), brings the nodes down and reaps.
# The tests are the suite's, in Go: this only launches them.
#
# Prints, last:
#   RESULT conformance_<proxy>_<backend> passed=N failed=N skipped=N junit=<path>
# (<backend> is "apiserver" for kube-proxy: the apiserver's own allocator.) Counts are of the
# specs the focus selected; a spec the suite skips itself (e.g. it needs two nodes) is
# skipped. The JUnit report, e2e.test's log, the node's logs (node-logs/) and the logs of
# the kube-system and clusterip-system pods (pod-logs/) stay in target/conformance/<config>-<date>/.
# Exit status: 0 when nothing failed.
#
# Always skipped: [Disruptive], [Serial], [Flaky], [Feature:…] and LoadBalancer tests
# (docs/conformance.md says why each is out).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. "$repo/scripts/lib/run.sh"

node=$repo/scripts/node-cluster.sh
builder=$repo/scripts/lib/build-go-binaries.sh
proxy=clusterip backend= timeout_min=60 set=proxy focus= skip= procs=3 nodes=2
selection='\[sig-network\] (Services|Service CIDRs|ServiceCIDR and IPAddress API|Networking Granular Checks: Services|Conntrack|EndpointSlice|EndpointSliceMirroring) '
always_skip='\[Disruptive\]|\[Serial\]|\[Flaky\]|\[Feature:[^]]+\]|LoadBalancer'

log() { echo "conformance: $*" >&2; }
die() { log "error: $*"; exit 2; }
usage() { sed -n '/^#   scripts\/conformance.sh/,/^#  *--procs N/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --proxy) proxy=${2:?}; shift 2 ;;
    --backend) backend=${2:?}; shift 2 ;;
    --set) set=${2:?}; shift 2 ;;
    --focus) focus=${2:?}; shift 2 ;;
    --skip) skip=${2?}; shift 2 ;;
    --procs) procs=${2:?}; shift 2 ;;
    --nodes) nodes=${2:?}; shift 2 ;;
    --timeout) timeout_min=${2:?}; shift 2 ;;
    -h|--help) usage ;;
    *) log "unknown argument '$1'"; usage ;;
  esac
done
[[ $timeout_min =~ ^[1-9][0-9]*$ ]] || die "--timeout takes whole minutes, not '$timeout_min'"
[[ $procs =~ ^[1-9][0-9]?$ ]] || die "--procs takes a number of processes (1-99), not '$procs'"
case "$nodes" in 1|2|3) export CLUSTERIP_NODE_WORKERS=$((nodes - 1)) ;; *) die "--nodes takes 1, 2 or 3, not '$nodes'" ;; esac
case "$set" in
  proxy) : "${focus:=$selection}" ;;
  conformance) : "${focus:=$selection.*\[Conformance\]}" ;;
  smoke) : "${focus:=\[sig-network\] (Services should serve a basic endpoint from pods|Services should be able to create a functioning NodePort service|Services should have session affinity work for service with type clusterIP|ServiceCIDR and IPAddress API should support IPAddress API operations)}" ;;
  *) die "--set takes proxy, conformance or smoke, not '$set'" ;;
esac
: "${skip:=$always_skip}"
case "$proxy" in
  kube-proxy)
    # (No clusterip, so no clusterip backend: a --backend here would be ignored, so refuse it.)
    [ -z "$backend" ] || die "--backend $backend: --proxy kube-proxy runs the apiserver's own allocator, no clusterip backend"
    backend=apiserver ;;
  clusterip)
    backend=${backend:-ipaddress}
    case "$backend" in
      ipaddress|etcd) export CLUSTERIP_NODE_BACKEND=$backend ;;
      *) die "--backend takes ipaddress or etcd, not '$backend'" ;;
    esac ;;
  *) die "--proxy takes kube-proxy or clusterip, not '$proxy'" ;;
esac
config=${proxy}_$backend
out=$repo/target/conformance/$config-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
started=$SECONDS

# The node's own logs and those of the add-ons' pods, kept beside the report.
save_logs() {
  [ -f "$CLUSTERIP_NODE_DIR/admin.kubeconfig" ] || return 0
  cp -r "$CLUSTERIP_NODE_DIR/logs" "$out/node-logs" 2>/dev/null || true
  mkdir -p "$out/pod-logs"
  local ns pod
  for ns in kube-system clusterip-system; do
    for pod in $("$node" kubectl -n "$ns" get pods -o name 2>/dev/null); do
      "$node" kubectl -n "$ns" logs "$pod" --all-containers --timestamps \
        > "$out/pod-logs/$ns.${pod#pod/}.log" 2>&1 || true
    done
  done
}

# When the suite failed, what its pods met, in few enough lines to stay in a CI log's tail:
# the events e2e.test dumped for the failed specs other than a normal start, the nodes'
# conditions and taints, kubelet's most frequent errors. (Everything is in $out.)
why_failed() {
  [ -f "$out/e2e.log" ] || return 0
  log "why: events of the failed specs other than a normal start (count, reason: message):"
  grep -h 'dump.go:53\] At .* - event for ' "$out/e2e.log" | sed -E 's/^.* - event for [^:]*: \{[^}]*\} //' |
    grep -vE '^(Scheduled|Pulling|Pulled|Created|Started|Killing|SuccessfulCreate|SuccessfulDelete):' |
    cut -c1-200 | sort | uniq -c | sort -rn | head -n 8 >&2 || true
  log "why: nodes (conditions that are True, taints):"
  "$node" kubectl get nodes -o jsonpath='{range .items[*]}  {.metadata.name}: {range .status.conditions[?(@.status=="True")]}{.type} {end}taints: {.spec.taints[*].key}{"\n"}{end}' >&2 2>/dev/null || true
  log "why: kubelet's most frequent errors (logs/kubelet.log):"
  grep -h '^E[0-9]' "$CLUSTERIP_NODE_DIR"/logs/kubelet.log "$CLUSTERIP_NODE_DIR"/logs/node-*/kubelet.log 2>/dev/null |
    sed -E 's/^E[0-9]+ [0-9:.]+ +[0-9]+ //' | cut -c1-200 | sort | uniq -c | sort -rn | head -n 5 >&2 || true
}

e2e_pid=
e2e_ran=
finish() {
  local rc=$?
  # (TERM to `timeout`: it passes it on to run-capped, which ends e2e.test and what it ran.)
  if [ -n "$e2e_pid" ] && kill -0 "$e2e_pid" 2>/dev/null; then
    log "stopping e2e.test"
    kill -TERM "$e2e_pid" 2>/dev/null; wait "$e2e_pid" 2>/dev/null
  fi
  [ "$rc" = 0 ] || [ -z "$e2e_ran" ] || why_failed
  save_logs
  "$node" down >&2 || true
  "$node" reap >&2 || true
  run_end
  log "$((SECONDS - started))s in all; logs in $out"
  exit $rc
}

run_begin conformance
"$node" reap >&2 || true
export CLUSTERIP_NODE_DIR=${CLUSTERIP_NODE_DIR:-${TMPDIR:-/tmp}/cipnode-conformance-$$}
trap finish EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- build what is missing
t0=$SECONDS
"$builder" e2e.test ginkgo kubectl || die "building e2e.test failed"
eval "$("$builder" print-dirs)"
"$repo/scripts/lib/build-e2e-images.sh" || die "building the e2e suite's images failed"
# (pause is the node's sandbox image, in both configurations.)
images=(pause)
if [ "$proxy" = clusterip ]; then images+=(clusterip clusterip-agent); else images+=(kube-proxy); fi
scripts/build-images.sh "${images[@]}" >&2 || die "building ${images[*]} failed"
log "builds: $((SECONDS - t0))s"

# ---------------------------------------------------------------- the node
t0=$SECONDS
if [ "$proxy" = kube-proxy ]; then export CLUSTERIP_NODE_PROXY=kube-proxy; else export CLUSTERIP_NODE_PROXY=clusterip-agent; fi
# (clusterip's images were built above, or are not needed: up imports what target/images has.
# CLUSTERIP_NODE_DNS=1: kubelet points pods at the cluster DNS deployed below.)
CLUSTERIP_NODE_DNS=1 CLUSTERIP_NODE_BUILD_IMAGES=0 "$node" up >&2 || die "the node did not come up"
"$repo/scripts/lib/build-e2e-images.sh" --load || die "loading the e2e suite's images failed"
if [ "$proxy" = clusterip ]; then
  "$node" deploy >&2 || die "deploying clusterip failed"
fi
# (After clusterip: its webhook then admits kube-dns's address, as every other Service's.)
"$node" dns >&2 || die "deploying the cluster DNS failed"
log "node ready ($config): $((SECONDS - t0))s"

# ---------------------------------------------------------------- the suite
t0=$SECONDS
junit=$out/junit.xml
log "running e2e.test on $procs ginkgo processes (focus: $focus; skip: $skip; at most $timeout_min min); log: $out/e2e.log"
# The ginkgo CLI runs the compiled suite on --procs processes and merges their reports.
# (--num-nodes: the suite's own count, which tests needing two nodes check; unset it is -1
# and they skip with "Requires at least 2 nodes (not -1)".)
# (ginkgo's own timeout ends the suite with a report; the outer one bounds a hung process.)
timeout --kill-after=30s "$((timeout_min * 60 + 300))s" \
  "$repo/scripts/lib/run-capped.sh" $((2048 + 1024 * procs)) -- \
  "$node" exec env PATH="$K8S_BIN:$PATH" HOME="$out" "$K8S_BIN/ginkgo" \
    --procs="$procs" --focus="$focus" --skip="$skip" --timeout="${timeout_min}m" \
    --output-dir="$out" --junit-report=junit.xml --no-color -v --silence-skips \
    "$K8S_BIN/e2e.test" -- \
    --provider=local --kubeconfig="$CLUSTERIP_NODE_DIR/admin.kubeconfig" \
    --kubectl-path="$K8S_BIN/kubectl" --report-dir="$out" --num-nodes="$nodes" \
    > "$out/e2e.log" 2>&1 &
# (In the background, so that INT/TERM reach this shell's trap while the suite runs.)
e2e_pid=$!
wait "$e2e_pid"
e2e_rc=$?
e2e_pid=
e2e_ran=1
log "e2e.test exited $e2e_rc after $((SECONDS - t0))s"
grep -E '^(Ran [0-9]+ of|FAIL!|SUCCESS!|run-capped:)' "$out/e2e.log" >&2 || tail -n 20 "$out/e2e.log" >&2

# The node's memory (its cgroup's peak: every process of the node and its pods).
cg=$(cat "$CLUSTERIP_NODE_DIR/cgroup" 2>/dev/null || true)
[ -n "$cg" ] && [ -f "/sys/fs/cgroup/memory$cg/memory.max_usage_in_bytes" ] &&
  log "node memory peak: $(( $(cat "/sys/fs/cgroup/memory$cg/memory.max_usage_in_bytes") / 1048576 )) MiB"

# Counts from the JUnit report: specs the focus did not select are listed there as skipped
# with no reason; they are not counted.
[ -f "$junit" ] || { echo "RESULT conformance_$config passed=0 failed=0 skipped=0 junit=none (e2e.test exited $e2e_rc)"; exit 1; }
python3 - "$junit" "$config" "$out/results.tsv" <<'PY'
import sys, xml.etree.ElementTree as ET
junit, config, tsv = sys.argv[1:]
counts = {"passed": 0, "failed": 0, "skipped": 0}
rows = []
for case in ET.parse(junit).iter("testcase"):
    name = case.get("name", "")
    failure = case.find("failure") if case.find("failure") is not None else case.find("error")
    suite_node = name.startswith(("[SynchronizedBeforeSuite]", "[SynchronizedAfterSuite]",
                                  "[BeforeSuite]", "[AfterSuite]", "[ReportBeforeSuite]", "[ReportAfterSuite]"))
    if suite_node and failure is None:
        continue  # the suite's set-up and reports: counted only when they fail
    if failure is not None:
        state, why = "failed", (failure.get("message") or "").splitlines()[0:1]
    elif case.find("skipped") is not None:
        why = case.find("skipped").get("message") or ""
        if why.strip() in ("", "skipped"):
            continue  # not selected by the focus
        state, why = "skipped", [why]
    else:
        state, why = "passed", []
    counts[state] += 1
    rows.append(f"{state}\t{name}\t{' '.join(why)[:300]}")
with open(tsv, "w") as f:
    f.write("\n".join(rows) + "\n")
for r in rows:
    print("  " + r, file=sys.stderr)
print(f"RESULT conformance_{config} passed={counts['passed']} failed={counts['failed']} "
      f"skipped={counts['skipped']} junit={junit}")
sys.exit(1 if counts["failed"] else 0)
PY
