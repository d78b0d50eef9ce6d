#!/usr/bin/env bash
# The user's checks on a real one-node cluster: builds the images (scripts/build-images.sh),
# brings a node up (scripts/node-cluster.sh, a node of its own in a temporary directory,
# owned by this run), deploys deploy/ as a user does, runs the checks below as tests, and
# brings the node down — also when a check fails or the run is interrupted; a killed run's
# node is removed by the next `scripts/node-cluster.sh reap` (every `up` and run starts with one).
#
#   scripts/test-node.sh            all checks; prints "ok/not ok" lines and "N passed, N failed"
#   CLUSTERIP_NODE_KEEP=1 …         leave the node up at the end (its dir is printed)
#   CLUSTERIP_NODE_WORKERS=1 …      two nodes (scripts/node-cluster.sh's worker), and the
#                                   two-nodes check; the default is one node
#   CLUSTERIP_NODE_WORKERS=2 …      three nodes (two workers), and the three-nodes check
#
# Checks:
#   deploy      2 controller replicas Ready, a leader, the agent Ready; the webhook called by
#               the kube-apiserver through its Service's ClusterIP, which the agent programs
#   workload    a Deployment serving HTTP and UDP behind a NodePort Service: its ClusterIP is
#               clusterip's (range, IPAddress with parentRef); a client pod reaches it by VIP
#               (HTTP, UDP); the NodePort answers from outside the node's namespace
#   two-nodes   (CLUSTERIP_NODE_WORKERS=1 only) a pod on each node reaches, by ClusterIP, a
#               Service whose only endpoint is a pod on the other node; both NodePorts answer
#               from outside on both nodes' addresses
#   three-nodes (CLUSTERIP_NODE_WORKERS=2 only) the same on three nodes: a pod on each node
#               reaches each other node's pod by ClusterIP (six pairs, to and from the third
#               node among them); the three NodePorts answer from outside on all three
#               nodes' addresses (.2, .3 and .4 of the link)
#   scaling     3 replicas: all three answer through the VIP; 1 replica: only that one does
#   release     deleting the Service releases its address: a new Service gets it
#   rbac        kubectl auth can-i as each ServiceAccount: every permission used is granted,
#               nothing beyond (no Secrets, no wildcards, no Service writes)
#   restart     rolling restarts of the controller Deployment and of the agent DaemonSet
#               while Services are created and VIP connections made: no failure of either
# Bounded: every wait has a deadline; the whole run stops after CLUSTERIP_NODE_TEST_TIMEOUT
# seconds (default 1800).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. "$repo/scripts/lib/run.sh"

node=$repo/scripts/node-cluster.sh
ns=node-test
NODE_IP=198.18.240.2
WORKERS=${CLUSTERIP_NODE_WORKERS:-0}
# Node n's name and address (scripts/node-cluster.sh: clusterip-node at .2, workers at .3, .4).
node_name() { if [ "$1" = 1 ]; then echo clusterip-node; else echo "clusterip-node-$1"; fi; }
node_ip() { echo "198.18.240.$(($1 + 1))"; }
passed=0 failed=0
started=$SECONDS
deadline=$((SECONDS + ${CLUSTERIP_NODE_TEST_TIMEOUT:-1800}))

log() { echo "test-node: $*" >&2; }
k() { "$node" kubectl "$@"; }
ok() { passed=$((passed + 1)); echo "ok - $*"; }
notok() { failed=$((failed + 1)); echo "not ok - $*"; }
# check NAME FUNCTION: runs it; its stderr explains a failure.
check() {
  local name=$1 t0=$SECONDS; shift
  if [ $SECONDS -ge $deadline ]; then notok "$name (run deadline passed)"; return; fi
  if "$@"; then ok "$name ($((SECONDS - t0))s)"; else notok "$name ($((SECONDS - t0))s)"; fi
}
# until_ok SECS CMD…: until CMD succeeds, for at most SECS.
until_ok() {
  local secs=$1; shift
  local d=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $d ] || { log "gave up after ${secs}s: $*"; return 1; }
    sleep 1
  done
}
in_range() { python3 -c 'import ipaddress,sys; sys.exit(0 if ipaddress.ip_address(sys.argv[1]) in ipaddress.ip_network(sys.argv[2]) else 1)' "$1" "$2"; }

finish() {
  local rc=$?
  if [ "${CLUSTERIP_NODE_KEEP:-}" = 1 ]; then
    log "node left up in $CLUSTERIP_NODE_DIR (CLUSTERIP_NODE_DIR=$CLUSTERIP_NODE_DIR scripts/node-cluster.sh down)"
  else
    "$node" down >&2 || true
  fi
  run_end
  echo "test-node: $((SECONDS - started))s" >&2
  exit $rc
}

run_begin test-node
"$node" reap >&2 || true
export CLUSTERIP_NODE_DIR=${CLUSTERIP_NODE_DIR:-${TMPDIR:-/tmp}/cipnode-test-$$}
trap finish EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- bring-up
t0=$SECONDS
scripts/build-images.sh clusterip clusterip-agent pause node-test >&2 || { notok "images build"; echo "$passed passed, $failed failed"; exit 1; }
log "images: $((SECONDS - t0))s"
t0=$SECONDS
"$node" up >&2 || { notok "node up"; echo "$passed passed, $failed failed"; exit 1; }
log "node up: $((SECONDS - t0))s"

check_deploy() {
  "$node" deploy >&2 || return 1
  local ready holder pods
  ready=$(k -n clusterip-system get deployment clusterip-controller -o jsonpath='{.status.readyReplicas}')
  [ "$ready" = 2 ] || { log "controller ready replicas: $ready, want 2"; return 1; }
  until_ok 60 sh -c "$node kubectl -n clusterip-system get lease clusterip-controller -o jsonpath='{.spec.holderIdentity}' | grep -q ." || return 1
  holder=$(k -n clusterip-system get lease clusterip-controller -o jsonpath='{.spec.holderIdentity}')
  pods=$(k -n clusterip-system get pods -l app.kubernetes.io/name=clusterip-controller -o jsonpath='{.items[*].metadata.name}')
  [[ " $pods " == *" $holder "* ]] || { log "leader '$holder' is not one of the pods ($pods)"; return 1; }
  # The webhook Service's ClusterIP is in the agent's ruleset (the kube-apiserver calls the
  # webhook through it: a Service create below only succeeds through it).
  local vip; vip=$(k -n clusterip-system get service clusterip-webhook -o jsonpath='{.spec.clusterIP}')
  local rules; rules=$("$node" exec nft list table ip clusterip 2>&1)
  grep -qF "$vip" <<< "$rules" || { log "webhook VIP $vip not in the agent's table ip clusterip"; return 1; }
  # And the kube-apiserver (in the node's network namespace, as on a control-plane node)
  # called it through that address: a Service create leaves its connection in conntrack,
  # original destination the VIP, translated to a controller pod.
  k create namespace "$ns" >/dev/null 2>&1 || true
  k -n "$ns" create service clusterip probe --tcp=80 >/dev/null || { log "a Service create failed"; return 1; }
  k -n "$ns" delete service probe >/dev/null
  local flows; flows=$("$node" exec conntrack -L -p tcp --orig-dst "$vip" --orig-port-dst 443 2>/dev/null)
  grep -q "src=$NODE_IP dst=$vip .*dport=443 .*src=198\.18\.241\." <<< "$flows" ||
    { log "no connection from the kube-apiserver to $vip:443 in conntrack: $flows"; return 1; }
  log "controller: 2/2 Ready, leader $holder; the kube-apiserver calls the webhook through $vip:443 (clusterip-agent's rules → a controller pod)"
}

workload() {
  k create namespace "$ns" >/dev/null 2>&1 || true
  k apply -f - >/dev/null <<EOF
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
      containers:
      - name: serve
        image: clusterip-node-test:dev
        imagePullPolicy: Never
        ports: [{containerPort: 8080, protocol: TCP}, {containerPort: 9000, protocol: UDP}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: $ns}
spec:
  terminationGracePeriodSeconds: 0
  containers:
  - name: client
    image: clusterip-node-test:dev
    imagePullPolicy: Never
    command: [sleep, infinity]
EOF
}
web_service() {
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata: {name: web, namespace: $ns}
spec:
  type: NodePort
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
  - {name: udp, port: 9000, targetPort: 9000, protocol: UDP}
EOF
}
http_via() { timeout 15 "$node" kubectl -n "$ns" exec client -- curl -sS --max-time 3 "http://$1/"; }
udp_via() { timeout 15 "$node" kubectl -n "$ns" exec client -- sh -c "echo hi | socat -T2 - UDP:$1:9000"; }

vip=
check_workload() {
  workload
  web_service || return 1
  k -n "$ns" rollout status deployment/web --timeout=120s >&2 || return 1
  k -n "$ns" wait --for=condition=Ready pod/client --timeout=120s >&2 || return 1
  vip=$(k -n "$ns" get service web -o jsonpath='{.spec.clusterIP}')
  in_range "$vip" 198.18.242.128/25 || { log "web's ClusterIP $vip is not from clusterip's range 198.18.242.128/25"; return 1; }
  local parent
  parent=$(k get ipaddress "$vip" -o jsonpath='{.spec.parentRef.resource}/{.spec.parentRef.namespace}/{.spec.parentRef.name}')
  [ "$parent" = "services/$ns/web" ] || { log "IPAddress $vip parentRef: '$parent'"; return 1; }
  local out
  until_ok 30 http_via "$vip" || return 1
  out=$(http_via "$vip") && [[ $out == "http web-"* ]] || { log "HTTP via $vip: '$out'"; return 1; }
  until_ok 30 udp_via "$vip" || return 1
  out=$(udp_via "$vip") && [[ $out == "udp web-"* ]] || { log "UDP via $vip: '$out'"; return 1; }
  local np; np=$(k -n "$ns" get service web -o jsonpath='{.spec.ports[0].nodePort}')
  until_ok 30 "$node" ext curl -sS --max-time 3 "http://198.18.240.2:$np/" || return 1
  out=$("$node" ext curl -sS --max-time 3 "http://198.18.240.2:$np/")
  [[ $out == "http web-"* ]] || { log "NodePort $np from outside: '$out'"; return 1; }
  log "ClusterIP $vip (IPAddress → services/$ns/web): HTTP and UDP from a pod; NodePort $np from outside the node"
}

# Two or three nodes: per node a server pod and a client pod pinned to it (nodeName), and a
# NodePort Service per server. Each client reaches every other node's server by its Service's
# ClusterIP (the client's node's agent DNATs, the nodes' routes carry it across, the reply
# comes back through the same node); the outside reaches every Service on every node's address.
check_nodes() { # number of nodes
  local nodes=$1 n pods=()
  for ((n = 1; n <= nodes; n++)); do
    k apply -f - >/dev/null <<EOF || return 1
apiVersion: v1
kind: Pod
metadata: {name: node$n-web, namespace: $ns, labels: {app: node$n-web}}
spec:
  nodeName: $(node_name $n)
  terminationGracePeriodSeconds: 0
  containers:
  - name: serve
    image: clusterip-node-test:dev
    imagePullPolicy: Never
    ports: [{containerPort: 8080, protocol: TCP}]
    readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Pod
metadata: {name: node$n-client, namespace: $ns}
spec:
  nodeName: $(node_name $n)
  terminationGracePeriodSeconds: 0
  containers:
  - {name: client, image: clusterip-node-test:dev, imagePullPolicy: Never, command: [sleep, infinity]}
---
apiVersion: v1
kind: Service
metadata: {name: node$n-web, namespace: $ns}
spec:
  type: NodePort
  selector: {app: node$n-web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
EOF
    pods+=("pod/node$n-web" "pod/node$n-client")
  done
  k -n "$ns" wait --for=condition=Ready "${pods[@]}" --timeout=120s >&2 || return 1
  local from to v out np ip ips=()
  for ((from = 1; from <= nodes; from++)); do
    for ((to = 1; to <= nodes; to++)); do
      [ $to != $from ] || continue
      v=$(k -n "$ns" get service "node$to-web" -o jsonpath='{.spec.clusterIP}')
      until_ok 30 timeout 15 "$node" kubectl -n "$ns" exec "node$from-client" -- curl -sS --max-time 3 "http://$v/" || return 1
      out=$(timeout 15 "$node" kubectl -n "$ns" exec "node$from-client" -- curl -sS --max-time 3 "http://$v/")
      [ "$out" = "http node$to-web" ] || { log "node $from's client via $v (node$to-web): '$out'"; return 1; }
      log "node $from's client → $v → node$to-web on node $to: '$out'"
    done
  done
  for ((n = 1; n <= nodes; n++)); do ips+=("$(node_ip $n)"); done
  for ((to = 1; to <= nodes; to++)); do
    np=$(k -n "$ns" get service "node$to-web" -o jsonpath='{.spec.ports[0].nodePort}')
    for ip in "${ips[@]}"; do
      until_ok 30 "$node" ext curl -sS --max-time 3 "http://$ip:$np/" || return 1
      out=$("$node" ext curl -sS --max-time 3 "http://$ip:$np/")
      [ "$out" = "http node$to-web" ] || { log "NodePort $ip:$np (node$to-web) from outside: '$out'"; return 1; }
    done
    log "NodePort $np (node$to-web): answers from outside on ${ips[*]}"
  done
  for ((n = 1; n <= nodes; n++)); do
    k -n "$ns" delete service "node$n-web" >/dev/null
    k -n "$ns" delete pod "node$n-web" "node$n-client" --wait=false >/dev/null
  done
}

# The names that answer through the VIP in N requests, sorted, one line.
answering() {
  local i
  for i in $(seq 1 "$1"); do http_via "$vip" 2>/dev/null | awk '{print $2}'; done | sort -u | tr '\n' ' '
}
pods_of_web() { k -n "$ns" get pods -l app=web --field-selector=status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort | tr '\n' ' '; }
check_scaling() {
  [ -n "$vip" ] || return 1
  k -n "$ns" scale deployment/web --replicas=3 >/dev/null || return 1
  k -n "$ns" rollout status deployment/web --timeout=120s >&2 || return 1
  local want got d=$((SECONDS + 60))
  want=$(pods_of_web)
  while got=$(answering 24); [ "$got" != "$want" ]; do
    [ $SECONDS -lt $d ] || { log "3 replicas: answering '$got', pods '$want'"; return 1; }
  done
  k -n "$ns" scale deployment/web --replicas=1 >/dev/null || return 1
  until_ok 90 sh -c "[ \$($node kubectl -n $ns get pods -l app=web -o name | wc -l) = 1 ]" || return 1
  want=$(pods_of_web)
  d=$((SECONDS + 60))
  while got=$(answering 12); [ "$got" != "$want" ]; do
    [ $SECONDS -lt $d ] || { log "1 replica: answering '$got', pod '$want'"; return 1; }
  done
  log "3 replicas answered through $vip, then only $want"
}

check_release() {
  [ -n "$vip" ] || return 1
  k -n "$ns" delete service web >/dev/null || return 1
  until_ok 30 sh -c "! $node kubectl get ipaddress $vip" || { log "IPAddress $vip still there after the delete"; return 1; }
  k -n "$ns" apply -f - >/dev/null <<EOF || { log "a new Service could not take $vip"; return 1; }
apiVersion: v1
kind: Service
metadata: {name: again, namespace: $ns}
spec:
  clusterIP: $vip
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
EOF
  [ "$(k -n "$ns" get service again -o jsonpath='{.spec.clusterIP}')" = "$vip" ] || return 1
  k -n "$ns" delete service again >/dev/null
  log "$vip released on delete and taken again"
}

# can SA NAMESPACE VERB RESOURCE [--subresource/name…] → yes/no
can() { local sa=$1 n=$2; shift 2; k auth can-i "$@" -n "$n" --as="system:serviceaccount:$sa" 2>/dev/null | tr -d '\r'; }
expect() { # yes|no SA NS VERB RESOURCE…
  local want=$1 sa=$2 n=$3; shift 3
  local got; got=$(can "$sa" "$n" "$@")
  [ "$got" = "$want" ] || { log "can-i $* -n $n as $sa: $got, want $want"; rbac_bad=1; }
}
check_rbac() {
  rbac_bad=
  local c=clusterip-system:clusterip-controller a=kube-system:clusterip-agent v
  # The pods run as deploy/'s ServiceAccounts.
  [ "$(k -n clusterip-system get pods -l app.kubernetes.io/name=clusterip-controller -o jsonpath='{.items[*].spec.serviceAccountName}')" = "clusterip-controller clusterip-controller" ] || { log "controller pods' ServiceAccount"; rbac_bad=1; }
  [ "$(k -n kube-system get pods -l app.kubernetes.io/name=clusterip-agent -o jsonpath='{range .items[*]}{.spec.serviceAccountName}{"\n"}{end}' | sort -u)" = "clusterip-agent" ] || { log "agent pods' ServiceAccount"; rbac_bad=1; }
  # The controller: what it uses …
  for v in get list watch; do expect yes $c "$ns" $v services; done
  for v in get list watch patch; do expect yes $c default $v servicecidrs.networking.k8s.io; done
  expect yes $c default patch servicecidrs.networking.k8s.io --subresource=status
  for v in get list watch create delete; do expect yes $c default $v ipaddresses.networking.k8s.io; done
  for v in create patch; do expect yes $c "$ns" $v events.events.k8s.io; done
  # (Leases: the leader Lease and the address blocks' Leases, whose names are made per range
  # and block, so update is granted on every Lease of the namespace: deploy/rbac.yaml.)
  for v in get list watch create update patch delete; do expect yes $c clusterip-system $v leases.coordination.k8s.io; done
  expect yes $c clusterip-system update leases.coordination.k8s.io/clusterip-controller
  # … and nothing beyond.
  for v in create update patch delete; do expect no $c "$ns" $v services; done
  expect no $c default update ipaddresses.networking.k8s.io
  expect no $c kube-system create leases.coordination.k8s.io
  expect no $c kube-system update leases.coordination.k8s.io
  expect no $c "$ns" create events
  for v in get list watch; do expect no $c clusterip-system $v secrets; expect no $c kube-system $v secrets; done
  expect no $c "$ns" create pods
  expect no $c "$ns" '*' '*'
  expect no $c "$ns" get configmaps
  # The agent: watches Services, EndpointSlices, Nodes; writes events.k8s.io Events only.
  for v in list watch; do
    expect yes $a "$ns" $v services; expect yes $a "$ns" $v endpointslices.discovery.k8s.io; expect yes $a default $v nodes
  done
  for v in create patch; do expect yes $a "$ns" $v events.events.k8s.io; done
  expect no $a "$ns" update events.events.k8s.io
  expect no $a "$ns" create events
  expect no $a default get nodes
  for v in create update patch delete; do expect no $a "$ns" $v services; expect no $a "$ns" $v endpointslices.discovery.k8s.io; done
  expect no $a default patch nodes
  for v in get list watch; do expect no $a kube-system $v secrets; done
  expect no $a "$ns" create pods
  expect no $a "$ns" '*' '*'
  # Neither is bound to cluster-admin (or any role granting everything).
  for s in $c $a; do expect no "$s" default '*' '*.*' --all-namespaces; done
  [ -z "$rbac_bad" ]
}

# gone POD…: each pod is gone (a minute at most each).
gone() {
  local p
  for p in "$@"; do
    until_ok 60 sh -c "[ -z \"\$($node kubectl get pods -A --field-selector metadata.name=$p -o name)\" ]" ||
      { log "pod $p was not replaced"; return 1; }
  done
}

# Rolling restarts under load (until the old pods are gone, not only until the new are
# Ready: a terminating webhook replica is the delicate part): a client pod connects to the VIP in a loop, this script
# creates a Service every 0.5 s; both count failures until both rollouts are done.
check_restart() {
  web_service || return 1
  k -n "$ns" scale deployment/web --replicas=2 >/dev/null
  k -n "$ns" rollout status deployment/web --timeout=120s >&2 || return 1
  local v; v=$(k -n "$ns" get service web -o jsonpath='{.spec.clusterIP}')
  until_ok 30 http_via "$v" || return 1
  local conns="$CLUSTERIP_NODE_DIR/conns.log" before after
  before=$(k get pods -A -l 'app.kubernetes.io/name in (clusterip-controller,clusterip-agent)' -o jsonpath='{.items[*].metadata.name}')
  k -n "$ns" exec client -- sh -c "rm -f /tmp/stop; ok=0; bad=0; while [ ! -e /tmp/stop ]; do if curl -sS --max-time 2 -o /dev/null http://$v/; then ok=\$((ok+1)); else bad=\$((bad+1)); fi; sleep 0.1; done; echo \"\$ok \$bad\"" > "$conns" 2>&1 &
  local loader=$!
  local creates=0 create_fail=0 i=0
  ( k -n clusterip-system rollout restart deployment/clusterip-controller >&2 &&
    k -n clusterip-system rollout status deployment/clusterip-controller --timeout=240s >&2 &&
    k -n kube-system rollout restart daemonset/clusterip-agent >&2 &&
    k -n kube-system rollout status daemonset/clusterip-agent --timeout=180s >&2 &&
    gone $before && sleep 2 ) &
  local restarts=$!
  while kill -0 "$restarts" 2>/dev/null; do
    i=$((i + 1))
    if k -n "$ns" create service clusterip "load-$i" --tcp=80 >/dev/null 2>"$CLUSTERIP_NODE_DIR/create.err"; then creates=$((creates + 1))
    else create_fail=$((create_fail + 1)); log "create load-$i failed: $(cat "$CLUSTERIP_NODE_DIR/create.err")"; fi
    sleep 0.5
  done
  wait "$restarts"; local rrc=$?
  k -n "$ns" exec client -- touch /tmp/stop
  wait "$loader"
  local ok bad; read -r ok bad < <(tail -n 1 "$conns")
  log "during the restarts: $creates Services created, $create_fail failed; $ok VIP connections, $bad failed"
  after=$(k get pods -A -l 'app.kubernetes.io/name in (clusterip-controller,clusterip-agent)' -o jsonpath='{.items[*].metadata.name}')
  log "replaced: $before → $after"
  [ "$rrc" = 0 ] && [ "$create_fail" = 0 ] && [ "${bad:-x}" = 0 ] && [ "${ok:-0}" -gt 0 ]
}

check "deploy: kubectl apply -k deploy/, 2 controller replicas Ready, agent programs the webhook's ClusterIP" check_deploy
check "workload: ClusterIP from clusterip's range, HTTP+UDP by VIP from a pod, NodePort from outside" check_workload
case "$WORKERS" in
  1) check "two-nodes: a pod on each node reaches the other node's pod by ClusterIP; NodePorts on both nodes from outside" check_nodes 2 ;;
  2) check "three-nodes: a pod on each node reaches each other node's pod by ClusterIP; NodePorts on all three nodes from outside" check_nodes 3 ;;
esac
check "scaling changes the endpoints the VIP reaches" check_scaling
check "deleting a Service releases its address" check_release
check "rbac: kubectl auth can-i as the ServiceAccounts: what is used, nothing beyond" check_rbac
check "rolling restarts of controller and agent: no failed create, no failed connection" check_restart

echo "test-node: $passed passed, $failed failed"
[ "$failed" = 0 ]
