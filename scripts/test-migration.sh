#!/usr/bin/env bash
# docs/migration.md, run step by step on a real two-node cluster: a stock cluster (the
# kube-apiserver's own allocator, kube-proxy v<K8S_VERSION> in nftables mode as a
# DaemonSet) with Services created before the migration and clients connecting to their
# ClusterIPs (from a pod on each node) and NodePorts (from outside, on both nodes) every
# 200 ms throughout; then the guide's steps:
#
#   1 audit      the apiserver serves IPAddress and ServiceCIDR (≥ 1.33), the default
#                ServiceCIDR is Ready, every Service address has its IPAddress
#   2 install    deploy/ with the agent on labelled nodes only (none yet): the webhook assigns
#                a new Service's address, the old ones keep theirs
#   3 replace    kube-proxy node by node: label the node, kube-proxy's pod leaves it, the
#                agent's starts, `kube-proxy --cleanup` removes kube-proxy's leftover rules;
#                then kube-proxy's DaemonSet is deleted (its manifest kept for a rollback)
#   4 roll back  the reverse: kube-proxy's DaemonSet back, node by node the agent leaves and
#                `clusterip-agent --cleanup` removes its rules, then the webhooks and the
#                controller go; a Service created afterwards is the stock allocator's and
#                answers through kube-proxy
#
# Prints, last:
#   RESULT migration connections=N failed=N addresses_changed=N
# and exits 0 only when nothing failed, no address changed, and every step's check passed.
#
#   scripts/test-migration.sh                 (≈ 10 minutes once images are built)
#   CLUSTERIP_NODE_KEEP=1 scripts/test-migration.sh   leave the nodes up at the end
#
# Owns what it starts: the nodes (scripts/node-cluster.sh, CLUSTERIP_NODE_DIR, default a
# temporary directory) and the probes; all are removed at exit, also on failure or interrupt.
# Bounded: every wait has a deadline; the run gives up after CLUSTERIP_MIGRATION_TIMEOUT
# seconds (default 2400).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
# shellcheck source=lib/run.sh
. "$repo/scripts/lib/run.sh"
# shellcheck source=versions.env
. "$repo/scripts/versions.env"

node=$repo/scripts/node-cluster.sh
ns=migration
LABEL=clusterip.allocator/service-proxy
NODES=(clusterip-node clusterip-node-2)
NODE_IPS=(198.18.240.2 198.18.240.3)
CLUSTERIP_CIDR=198.18.242.128/25
export CLUSTERIP_NODE_WORKERS=1 CLUSTERIP_NODE_PROXY=kube-proxy CLUSTERIP_NODE_AGENT_ON=labelled
started=$SECONDS
deadline=$((SECONDS + ${CLUSTERIP_MIGRATION_TIMEOUT:-2400}))
probe_pids=()

log() { echo "test-migration: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
k() { "$node" kubectl "$@"; }
# until_ok SECS CMD…: run CMD every second until it succeeds; fails after SECS (or the run's deadline).
until_ok() {
  local secs=$1; shift
  local d=$((SECONDS + secs)); [ $d -lt $deadline ] || d=$deadline
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $d ] || { log "gave up after ${secs}s: $*"; return 1; }
    sleep 1
  done
}
in_range() { python3 -c 'import ipaddress,sys; sys.exit(0 if ipaddress.ip_address(sys.argv[1]) in ipaddress.ip_network(sys.argv[2]) else 1)' "$1" "$2"; }

stop_probes() {
  local p
  for p in "${probe_pids[@]}"; do kill -- "-$p" 2>/dev/null; done
  probe_pids=()
}

finish() {
  local rc=$?
  stop_probes
  if [ "${CLUSTERIP_NODE_KEEP:-}" = 1 ]; then
    log "nodes left up in $CLUSTERIP_NODE_DIR (CLUSTERIP_NODE_DIR=$CLUSTERIP_NODE_DIR scripts/node-cluster.sh down)"
  else
    "$node" down >&2 || true
  fi
  run_end
  log "$((SECONDS - started))s"
  exit $rc
}

run_begin test-migration
"$node" reap >&2 || true
export CLUSTERIP_NODE_DIR=${CLUSTERIP_NODE_DIR:-${TMPDIR:-/tmp}/cipnode-migration-$$}
out=$repo/target/migration/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
trap finish EXIT
trap 'exit 130' INT TERM

scripts/build-images.sh clusterip clusterip-agent pause node-test kube-proxy >&2 || die "building the images"
"$node" up >&2 || die "bringing the nodes up"

# ---------------------------------------------------------------- the cluster before
# A Service behind two pods (one a node), a NodePort, and a second, ClusterIP-only Service;
# a client pod on each node.
k create namespace "$ns" >/dev/null
k apply -f - >/dev/null <<EOF || die "the workload"
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: $ns}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: 2
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {app: web}}}
      containers:
      - name: serve
        image: clusterip-node-test:dev
        imagePullPolicy: Never
        ports: [{containerPort: 8080, protocol: TCP}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: $ns}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: web-internal, namespace: $ns}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
EOF
k -n "$ns" rollout status deployment/web --timeout=180s >&2 || die "the workload's pods"
vip=$(k -n "$ns" get service web -o jsonpath='{.spec.clusterIP}')
vip2=$(k -n "$ns" get service web-internal -o jsonpath='{.spec.clusterIP}')
np=$(k -n "$ns" get service web -o jsonpath='{.spec.ports[0].nodePort}')
addresses() { k get services -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name} {.spec.clusterIPs} {.spec.ports[*].nodePort}{"\n"}{end}' | sort; }
addresses > "$out/addresses-before.txt" || die "listing the Services"
log "before: web $vip (NodePort $np), web-internal $vip2; $(wc -l < "$out/addresses-before.txt") Services"

# The probes: one connection every 200 ms to each target, each a new connection with a 3 s
# limit; a line per try, "ok" or "FAIL <unix time> <target>".
loop='while :; do for t in $TARGETS; do if curl -sS -o /dev/null --max-time 3 "http://$t/" 2>/dev/null; then echo ok; else echo "FAIL $(date +%s) $t"; fi; done; sleep 0.2; done'
for i in 0 1; do
  k apply -f - >/dev/null <<EOF || die "client pod $i"
apiVersion: v1
kind: Pod
metadata: {name: client-$i, namespace: $ns}
spec:
  nodeName: ${NODES[$i]}
  terminationGracePeriodSeconds: 0
  containers:
  - name: probe
    image: clusterip-node-test:dev
    imagePullPolicy: Never
    env: [{name: TARGETS, value: "$vip $vip2"}]
    command: [sh, -c, '$loop']
EOF
done
k -n "$ns" wait --for=condition=Ready pod/client-0 pod/client-1 --timeout=120s >&2 || die "the client pods"
# (In a session of its own, so that stopping it stops the whole loop, not only its launcher.)
setsid "$node" ext env TARGETS="${NODE_IPS[0]}:$np ${NODE_IPS[1]}:$np" sh -c "$loop" > "$out/outside.log" 2>&1 &
probe_pids+=($!)
# Both probes answer before anything changes.
until_ok 60 sh -c "grep -q ok '$out/outside.log'" || die "the outside probe never got an answer"
until_ok 60 sh -c "$node kubectl -n $ns logs client-0 | grep -q ok && $node kubectl -n $ns logs client-1 | grep -q ok" || die "the client pods' probes never got an answer"
failures() { # every FAIL line so far, of both pods and the outside probe
  { k -n "$ns" logs client-0; k -n "$ns" logs client-1; cat "$out/outside.log"; } 2>/dev/null | grep -c '^FAIL' || true
}
checkpoint() { local f; f=$(failures); log "after $1: $f failed connection(s) so far"; }

# A pod on NODE running IMAGE with ARGS in the node's network (hostNetwork, NET_ADMIN), to
# completion; its log on stdout.
on_node() { # NAME NODE IMAGE ARGS…
  local name=$1 where=$2 image=$3; shift 3
  local args; args=$(printf '"%s",' "$@"); args="[${args%,}]"
  k -n kube-system delete pod "$name" --ignore-not-found >/dev/null
  k apply -f - >/dev/null <<EOF || return 1
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: kube-system}
spec:
  nodeName: $where
  hostNetwork: true
  restartPolicy: Never
  tolerations: [{operator: Exists}]
  containers:
  - name: run
    image: $image
    imagePullPolicy: IfNotPresent
    command: $args
    securityContext: {privileged: true}
EOF
  until_ok 120 sh -c "$node kubectl -n kube-system get pod $name -o jsonpath='{.status.phase}' | grep -Eq 'Succeeded|Failed'" || return 1
  k -n kube-system logs "$name"
  [ "$(k -n kube-system get pod "$name" -o jsonpath='{.status.phase}')" = Succeeded ] || return 1
  k -n kube-system delete pod "$name" --wait=false >/dev/null
}
tables_on() { on_node "tables-$1" "$1" clusterip-agent:dev nft list tables; }
# The node runs exactly this proxy's nftables tables (kube-proxy's "kube-proxy", the agent's "clusterip").
only_tables() { # NODE kube-proxy|clusterip
  local t; t=$(tables_on "$1") || return 1
  case "$2" in
    kube-proxy) grep -q 'table ip kube-proxy' <<< "$t" && ! grep -q 'table ip clusterip' <<< "$t" ;;
    clusterip) grep -q 'table ip clusterip' <<< "$t" && ! grep -q 'table ip kube-proxy' <<< "$t" ;;
  esac || { log "$1: tables $(tr '\n' ' ' <<< "$t"), want only $2's"; return 1; }
}
ready_pod_on() { # APP-LABEL NODE: a pod of that label is Ready on that node
  [ -n "$(k -n kube-system get pods -l "$1" --field-selector "spec.nodeName=$2" -o jsonpath='{range .items[?(@.status.containerStatuses[0].ready==true)]}{.metadata.name}{end}')" ]
}
no_pod_on() { [ -z "$(k -n kube-system get pods -l "$1" --field-selector "spec.nodeName=$2" -o name)" ]; }

# ---------------------------------------------------------------- 1 audit
server=$(k version -o json | python3 -c 'import json,sys; v=json.load(sys.stdin)["serverVersion"]; print(v["major"] + "." + v["minor"].rstrip("+"))') || die "reading the server version"
python3 -c 'import sys; ma,mi=map(int,sys.argv[1].split(".")); sys.exit(0 if (ma,mi)>=(1,33) else 1)' "$server" || die "server $server: clusterip needs ≥ 1.33 (IPAddress, ServiceCIDR)"
k get servicecidr kubernetes -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True || die "the default ServiceCIDR is not Ready"
missing=$(k get services -A -o jsonpath='{range .items[*]}{.spec.clusterIP}{"\n"}{end}' | grep -v '^None$' | grep . | while read -r ip; do k get ipaddress "$ip" -o name >/dev/null 2>&1 || echo "$ip"; done)
[ -z "$missing" ] || die "Service addresses without an IPAddress (repair them first): $missing"
log "1 audit: server $server, ServiceCIDR kubernetes Ready, every Service address has its IPAddress"

# ---------------------------------------------------------------- 2 install
"$node" deploy >&2 || die "installing deploy/"
k create -n "$ns" service clusterip installed --tcp=80:8080 >/dev/null || die "a Service create through the webhook"
ip=$(k -n "$ns" get service installed -o jsonpath='{.spec.clusterIP}')
in_range "$ip" "$CLUSTERIP_CIDR" || die "the new Service got $ip, not from clusterip's $CLUSTERIP_CIDR"
k get ipaddress "$ip" -o jsonpath='{.spec.parentRef.name}' | grep -qx installed || die "no IPAddress for $ip naming the Service"
for n in "${NODES[@]}"; do no_pod_on app.kubernetes.io/name=clusterip-agent "$n" || die "the agent runs on $n before it is labelled"; done
checkpoint "2 install (new Service $ip from clusterip; agent on no node)"

# ---------------------------------------------------------------- 3 replace kube-proxy
# kube-proxy keeps off labelled nodes (a rolling restart of its pods: their rules stay).
k -n kube-system patch daemonset kube-proxy --type=merge -p "{\"spec\":{\"template\":{\"spec\":{\"affinity\":{\"nodeAffinity\":{\"requiredDuringSchedulingIgnoredDuringExecution\":{\"nodeSelectorTerms\":[{\"matchExpressions\":[{\"key\":\"$LABEL\",\"operator\":\"NotIn\",\"values\":[\"clusterip-agent\"]}]}]}}}}}}}" >/dev/null || die "kube-proxy's node affinity"
k -n kube-system rollout status daemonset/kube-proxy --timeout=180s >&2 || die "kube-proxy's rollout"
for n in "${NODES[@]}"; do
  k label node "$n" "$LABEL=clusterip-agent" >/dev/null || die "labelling $n"
  until_ok 120 no_pod_on k8s-app=kube-proxy "$n" || die "kube-proxy's pod did not leave $n"
  until_ok 180 ready_pod_on app.kubernetes.io/name=clusterip-agent "$n" || die "the agent not Ready on $n"
  on_node "kube-proxy-cleanup" "$n" "registry.k8s.io/kube-proxy:v$K8S_VERSION" /usr/local/bin/kube-proxy --cleanup >/dev/null || die "kube-proxy --cleanup on $n"
  only_tables "$n" clusterip || die "tables on $n after the switch"
  checkpoint "3 replace on $n"
done
k -n kube-system get daemonset kube-proxy -o yaml > "$out/kube-proxy-daemonset.yaml" || die "saving kube-proxy's DaemonSet"
k -n kube-system delete daemonset kube-proxy >/dev/null || die "deleting kube-proxy's DaemonSet"
k create -n "$ns" service clusterip migrated --tcp=80:8080 >/dev/null || die "a Service create after the migration"
k -n "$ns" patch service migrated --type=merge -p '{"spec":{"selector":{"app":"web"}}}' >/dev/null
mig=$(k -n "$ns" get service migrated -o jsonpath='{.spec.clusterIP}')
until_ok 60 k -n "$ns" exec client-0 -- curl -sS --max-time 3 "http://$mig/" || die "a Service created after the migration does not answer through the agent ($mig)"
checkpoint "3 replace: every node on clusterip-agent, kube-proxy's DaemonSet deleted, a new Service ($mig) answers"

# ---------------------------------------------------------------- 4 roll back
python3 - "$out/kube-proxy-daemonset.yaml" <<'PY' > "$out/kube-proxy-restore.yaml" || die "preparing kube-proxy's DaemonSet"
import sys, yaml
d = yaml.safe_load(open(sys.argv[1]))
m = d["metadata"]
for k in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
    m.pop(k, None)
m.get("annotations", {}).pop("deprecated.daemonset.template.generation", None)
d.pop("status", None)
print(yaml.safe_dump(d))
PY
k apply -f "$out/kube-proxy-restore.yaml" >/dev/null || die "restoring kube-proxy's DaemonSet"
for ((i = ${#NODES[@]} - 1; i >= 0; i--)); do
  n=${NODES[$i]}
  k label node "$n" "$LABEL-" >/dev/null || die "unlabelling $n"
  until_ok 120 no_pod_on app.kubernetes.io/name=clusterip-agent "$n" || die "the agent did not leave $n"
  until_ok 180 ready_pod_on k8s-app=kube-proxy "$n" || die "kube-proxy not Ready on $n"
  on_node "clusterip-agent-cleanup" "$n" clusterip-agent:dev /usr/local/bin/clusterip-agent --cleanup >/dev/null || die "clusterip-agent --cleanup on $n"
  only_tables "$n" kube-proxy || die "tables on $n after the rollback"
  checkpoint "4 roll back $n"
done
k delete mutatingwebhookconfiguration,validatingwebhookconfiguration -l app.kubernetes.io/component=admission-registration,app.kubernetes.io/part-of=clusterip >/dev/null || die "removing the webhook registrations"
k delete -k "$CLUSTERIP_NODE_DIR/deploy" --ignore-not-found --wait=true --timeout=180s >/dev/null 2>&1 || die "removing clusterip"
k create -n "$ns" service clusterip rolled-back --tcp=80:8080 >/dev/null || die "a Service create after the rollback"
k -n "$ns" patch service rolled-back --type=merge -p '{"spec":{"selector":{"app":"web"}}}' >/dev/null
rb=$(k -n "$ns" get service rolled-back -o jsonpath='{.spec.clusterIP}')
manager=$(k get ipaddress "$rb" -o jsonpath='{.metadata.labels.ipaddress\.kubernetes\.io/managed-by}')
[ "$manager" = ipallocator.k8s.io ] || die "the Service after the rollback ($rb) is not the stock allocator's (managed-by '$manager')"
until_ok 60 k -n "$ns" exec client-1 -- curl -sS --max-time 3 "http://$rb/" || die "a Service created after the rollback does not answer through kube-proxy ($rb)"
checkpoint "4 roll back: kube-proxy on every node, clusterip removed, a new Service ($rb, the stock allocator's) answers"

# ---------------------------------------------------------------- results
stop_probes
{ k -n "$ns" logs client-0 > "$out/client-0.log"; k -n "$ns" logs client-1 > "$out/client-1.log"; } || die "reading the probes' logs"
total=$(cat "$out/client-0.log" "$out/client-1.log" "$out/outside.log" | grep -cE '^(ok|FAIL)')
failed=$(cat "$out/client-0.log" "$out/client-1.log" "$out/outside.log" | grep -c '^FAIL')
addresses | grep -Fvf <(printf '%s\n' "$ns/installed " "$ns/migrated " "$ns/rolled-back ") > "$out/addresses-after.txt"
changed=$(diff <(grep -v "^$ns/\(installed\|migrated\|rolled-back\) " "$out/addresses-before.txt") "$out/addresses-after.txt" | grep -c '^[<>]')
grep '^FAIL' "$out/client-0.log" "$out/client-1.log" "$out/outside.log" | head -20 >&2
log "logs and address lists in $out"
echo "RESULT migration connections=$total failed=$failed addresses_changed=$changed"
[ "$failed" = 0 ] && [ "$changed" = 0 ]
