#!/usr/bin/env bash
# The init process (pid 1) of a node made by scripts/node-cluster.sh: it runs inside the
# node's network namespace, in a mount and a pid namespace of its own, and starts the node's
# processes as its children: the control plane, containerd and kubelet on the first node
# (ROLE=control-plane), containerd and kubelet only on a worker (ROLE=worker). When it exits (SIGTERM: `down`; or its parent
# `unshare` is killed), the kernel kills every process of the pid namespace, the mounts made
# here vanish with the mount namespace, and the pods' network namespaces with them.
#
#   node-init.sh NODE_DIR         (never run by hand: scripts/node-cluster.sh up)
#
# NODE_DIR holds the node's node.env, containerd.toml, kubelet.yaml, kubelet.kubeconfig, and
# gets its containerd root, kubelet root and node-pids: the state dir
# itself for the first node, <state>/node-<n> for worker n (2, 3).
#
# Private to the node (mounted here, gone with it): /run (containerd's sockets and state,
# the pods' network namespaces, xtables.lock), /var/lib (CNI's cache) and /var/log (pod
# logs), and three kernel sysctls kubelet would otherwise set machine-wide (below).
set -uo pipefail
state=$1
# shellcheck source=/dev/null
. "$state/node.env"
ROLE=${ROLE:-control-plane}
logs=${LOGS:-$state/logs}
mkdir -p "$logs"
children=()

log() { echo "node-init: $(date -u +%T) $*"; }

# Children are stopped in reverse order of start; pid 1 ignores signals it has no handler for.
stopping=
stop_all() {
  stopping=1
  log "stopping"
  local i
  for ((i = ${#children[@]} - 1; i >= 0; i--)); do kill -TERM "${children[$i]}" 2>/dev/null || true; done
  local deadline=$((SECONDS + 15))
  while [ $SECONDS -lt $deadline ]; do
    local alive=
    for i in "${children[@]}"; do kill -0 "$i" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.2
  done
  exit 0
}
trap stop_all TERM INT

spawn() {
  local name=$1; shift
  "$@" >"$logs/$name.log" 2>&1 < /dev/null &
  children+=($!)
  echo "$name $!" >> "$state/node-pids"
  log "started $name (pid $! in the node)"
}

wait_for() {
  local what=$1 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { log "error: $what not ready after ${SECONDS}s"; return 1; }
    sleep 0.3
  done
  log "$what ready"
}

# ---------------------------------------------------------------- the node's own mounts
mount -t tmpfs -o mode=0755,size=256m tmpfs /run
mount -t tmpfs -o mode=0755,size=256m tmpfs /var/lib
mount -t tmpfs -o mode=0755,size=512m tmpfs /var/log
mkdir -p /run/netns /run/containerd
# kubelet sets vm.overcommit_memory=1, kernel.panic=10 and kernel.panic_on_oops=1 when they
# differ (protectKernelDefaults: false), or refuses to start (true). Those are machine-wide,
# not namespaced: the node shows kubelet the values it wants instead, from files bound over
# them in its own mount namespace. The machine's values stay as they are.
mkdir -p "$state/sysctl"
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1; do
  k=${kv%=*} v=${kv#*=}
  [ "$(cat "/proc/sys/$k")" = "$v" ] && continue
  f=$state/sysctl/${k//\//.}
  echo "$v" > "$f"
  mount --bind "$f" "/proc/sys/$k"
done
: > "$state/node-pids"

# ---------------------------------------------------------------- control plane
start_control_plane() {
  spawn etcd "$ETCD_BIN/etcd" --name node --data-dir "$state/etcd" \
    --listen-client-urls "$ETCD_CLIENT_URLS" --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster node=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381 \
    --quota-backend-bytes 2147483648 --log-level warn
  wait_for etcd 60 curl -fsS http://127.0.0.1:2381/health || stop_all

  pki=$state/pki
  spawn kube-apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers http://127.0.0.1:2379 \
    --bind-address 0.0.0.0 --advertise-address "$NODE_IP" --secure-port 6443 \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range "$SERVICE_CIDR" --service-node-port-range 30000-32767 \
    --authorization-mode Node,RBAC --allow-privileged \
    --enable-admission-plugins NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
    --admission-control-config-file "$state/webhook-certs/apiserver/admission-config.yaml" \
    --profiling=false --v 1
  wait_for kube-apiserver 180 curl -fsS --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" "https://$NODE_IP:6443/readyz" || stop_all

  spawn kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$state/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig "$state/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig "$state/kube-controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10257 --leader-elect=false \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --use-service-account-credentials --service-cluster-ip-range "$SERVICE_CIDR" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --profiling=false --v 1
  spawn kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig "$state/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig "$state/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig "$state/kube-scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10259 --leader-elect=false --profiling=false --v 1
}
# (A worker's kubelet reaches the first node's kube-apiserver over the nodes' link.)
[ "$ROLE" = worker ] || start_control_plane

# ---------------------------------------------------------------- container runtime
spawn containerd "$CONTAINERD_BIN/containerd" --config "$state/containerd.toml"
wait_for containerd 60 "$CONTAINERD_BIN/ctr" --address /run/containerd/containerd.sock version || stop_all
for img in "$IMAGES_DIR"/*.oci.tar; do
  [ -f "$img" ] || continue
  "$CONTAINERD_BIN/ctr" --address /run/containerd/containerd.sock -n k8s.io images import \
    --no-unpack --local "$img" >/dev/null 2>>"$logs/images.log" && log "imported ${img##*/}" ||
    log "error: could not import ${img##*/} (log: $logs/images.log)"
done

# ---------------------------------------------------------------- kubelet
# (kube-proxy, with CLUSTERIP_NODE_PROXY=kube-proxy, is a DaemonSet: node-cluster.sh applies it.)
spawn kubelet "$K8S_BIN/kubelet" --config "$state/kubelet.yaml" \
  --kubeconfig "$state/kubelet.kubeconfig" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" \
  --root-dir "$state/kubelet" --v 1
echo ready > "$state/init-ready"
log "all started"

# pid 1 reaps every orphan of the namespace (container shims re-parented here).
while :; do
  wait -n 2>/dev/null || sleep 1
  [ -n "$stopping" ] && continue
  for i in "${!children[@]}"; do
    kill -0 "${children[$i]}" 2>/dev/null || { log "child ${children[$i]} exited ($(grep " ${children[$i]}\$" "$state/node-pids" | cut -d' ' -f1))"; unset 'children[i]'; children=("${children[@]}"); break; }
  done
done
