#!/usr/bin/env bash
# A real one-node Kubernetes on this machine, the way a kind node is one: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, containerd (+ runc, CNI) and kubelet
# in a network namespace of their own (and mount and pid namespaces: scripts/lib/node-init.sh),
# with a cgroup subtree of their own. clusterip-agent (deploy/agent) is the node's Service
# dataplane: there is no kube-proxy (CLUSTERIP_NODE_PROXY=kube-proxy runs one instead, as a
# stock install does: the DaemonSet of tests/node/kube-proxy.yaml, applied by `up`, image
# from scripts/build-images.sh kube-proxy).
#
#   scripts/node-cluster.sh up        build what is missing (cached), start the node, wait
#                                     until the node is Ready; prints how to reach it
#   scripts/node-cluster.sh deploy    certificates (scripts/gen-webhook-certs.sh) and
#                                     `kubectl apply -k` of deploy/ (through a thin overlay
#                                     with this node's ranges), wait for the agent and both
#                                     controller replicas (CLUSTERIP_NODE_BACKEND=etcd, at up
#                                     and deploy: the etcd backend, on the node's etcd;
#                                     CLUSTERIP_NODE_AGENT_ON=labelled: the agent only on nodes
#                                     labelled clusterip.allocator/service-proxy=clusterip-agent,
#                                     for scripts/test-migration.sh)
#   scripts/node-cluster.sh down      stop the node and remove all of it
#   scripts/node-cluster.sh status    say what runs; exit 0 when the node (and the workers,
#                                     if there are any) is up and Ready
#   scripts/node-cluster.sh reap      remove nodes whose owner is gone, and namespaces and
#                                     cgroups of nodes whose directory is gone
#   scripts/node-cluster.sh kubectl …   kubectl against the node (from inside its network)
#   scripts/node-cluster.sh exec CMD …  run CMD in the node's network namespace
#   scripts/node-cluster.sh ext CMD …   run CMD in the "outside" namespace (a client on the
#                                     node's link, like another machine of its LAN)
#   scripts/node-cluster.sh dns       CoreDNS (tests/node/coredns.yaml, image from
#                                     scripts/build-images.sh coredns) as the cluster DNS at
#                                     $CLUSTER_DNS_IP; needs a node brought up with
#                                     CLUSTERIP_NODE_DNS=1 (kubelet's clusterDNS)
#   scripts/node-cluster.sh load-images [DIR]   import target/images/*.oci.tar again (after
#                                     scripts/build-images.sh), or DIR/*.oci.tar (the e2e
#                                     suite's images: scripts/lib/build-e2e-images.sh --load),
#                                     into every node's containerd
#
# CLUSTERIP_NODE_WORKERS=1 (at up; default 0) adds a worker node, clusterip-node-2; =2 adds
# two, clusterip-node-2 and clusterip-node-3 (three schedulable nodes: what Kubernetes' e2e
# "should implement NodePort and HealthCheckNodePort correctly when ExternalTrafficPolicy
# changes" needs). Each worker has a network, mount and pid namespace, containerd and kubelet
# (and kube-proxy with the switch) of its own, state in <state>/node-<n>, on the same link;
# the first node keeps the control plane.
#
#   CLUSTERIP_NODE_WORKERS=2 scripts/node-cluster.sh up    three nodes, each Ready
#
# Addresses (198.18.240.0/22, used by no test): the nodes' link 198.18.240.0/24 (a bridge in
# the outside namespace: outside .1, node .2, workers .3 and .4), pods 198.18.241.0/24 (CNI
# ptp + host-local; with workers it is cut in equal parts, one a node in order: two nodes
# .0/25 and .128/25, three nodes .0/26, .64/26 and .128/26; every node routes every other
# node's part to that node over the link), Services 198.18.242.0/24 (the kube-apiserver's
# range) of which clusterip hands out 198.18.242.128/25.
#
# Owners (scripts/lib/owners.sh): with CLUSTERIP_OWNER_PID=<pid> the node is owned by that
# process (<state>/owner) and `reap` (this one, and every `up`) removes it once the owner is
# gone. State lives in .node/ at the repository root (git-ignored) or CLUSTERIP_NODE_DIR.
# Everything the node mounts lives in its mount namespace; its processes in its pid namespace:
# killing the node's init (or its `unshare` parent) ends all of it. docs/node.md.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=$(realpath -m "${CLUSTERIP_NODE_DIR:-$repo/.node}")
builder="$repo/scripts/lib/build-go-binaries.sh"
# shellcheck source=versions.env
. "$repo/scripts/versions.env"
# shellcheck source=lib/owners.sh
. "$repo/scripts/lib/owners.sh"

NODE_NAME=clusterip-node
NODE_IP=198.18.240.2
EXT_IP=198.18.240.1
POD_CIDR=198.18.241.0/24
# Workers (CLUSTERIP_NODE_WORKERS=1|2): node n (1 the first, 2 and 3 the workers) is
# clusterip-node-<n> at .<n+1> of the link, and the pod network is cut in equal parts, one a
# node (as kube-controller-manager's node CIDR allocator cuts a --cluster-cidr): /25s for two
# nodes, /26s for three. Every cluster-wide setting that names the pod network (kube-proxy's
# clusterCIDR, the NetworkPolicy's except) stays POD_CIDR, and neither the link nor the
# Service range is inside it. 126 addresses a node with two, 62 with three, for maxPods 60.
WORKERS=${CLUSTERIP_NODE_WORKERS:-0}
MAX_WORKERS=2
case "$WORKERS" in 0|1|2) ;; *) echo "node-cluster: CLUSTERIP_NODE_WORKERS is 0, 1 or 2, not '$WORKERS'" >&2; exit 2 ;; esac
NODES=$((WORKERS + 1))
node_name() { if [ "$1" = 1 ]; then echo "$NODE_NAME"; else echo "clusterip-node-$1"; fi; }
node_ip() { echo "198.18.240.$(($1 + 1))"; }
# Node n's part of POD_CIDR: the /24 for one node, a /25 each for two, a /26 each for three.
node_pod_range() {
  local bits=24 size
  case "$NODES" in 2) bits=25 ;; 3) bits=26 ;; esac
  size=$((1 << (32 - bits)))
  echo "198.18.241.$(( ($1 - 1) * size ))/$bits"
}
NODE_POD_RANGE=$(node_pod_range 1)
SERVICE_CIDR=198.18.242.0/24
CLUSTERIP_CIDR=198.18.242.128/25
APISERVER_VIP=198.18.242.1
# The cluster DNS Service (kube-dns), when CLUSTERIP_NODE_DNS=1: an address of clusterip's
# range too (its static band), so the same manifest is admitted in both configurations.
CLUSTER_DNS_IP=198.18.242.138
PROXY=${CLUSTERIP_NODE_PROXY:-clusterip-agent}
# clusterip's backend (deploy): ipaddress, or etcd — then the node's etcd also serves clients
# on the node's address (plain HTTP, reachable from the pods only: the node's link and pod
# network are the node's own) and the controller keeps its records there, under its own prefix.
BACKEND=${CLUSTERIP_NODE_BACKEND:-ipaddress}
case "$BACKEND" in ipaddress|etcd) ;; *) echo "node-cluster: CLUSTERIP_NODE_BACKEND is ipaddress or etcd, not '$BACKEND'" >&2; exit 2 ;; esac
# Where deploy runs the agent: every node (all), or only nodes labelled
# clusterip.allocator/service-proxy=clusterip-agent (labelled: a migration from kube-proxy
# node by node, docs/migration.md; none is labelled at deploy).
AGENT_ON=${CLUSTERIP_NODE_AGENT_ON:-all}
case "$AGENT_ON" in all|labelled) ;; *) echo "node-cluster: CLUSTERIP_NODE_AGENT_ON is all or labelled, not '$AGENT_ON'" >&2; exit 2 ;; esac
MEMORY_LIMIT=${CLUSTERIP_NODE_MEMORY:-6G}
WORKER_MEMORY_LIMIT=${CLUSTERIP_NODE_WORKER_MEMORY:-4G}
registry="${TMPDIR:-/tmp}/clusterip-nodes"
WEBHOOK_CLIENT_NAME=kube-apiserver-webhook-client

log() { echo "node-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Names of this state dir's nodes: network namespaces and cgroups, from a hash of the path.
# Worker n's files are in <state>/node-<n> (node_dir n): whether it exists says whether there
# is that worker, for every command after up. Its namespace is cipnode<n>-<id>, not
# cipnode-<id>-…: a reap of the one-node scripts takes any cipnode-<x>[-ext] for the node of
# id <x>, and would remove a live worker's namespace as a node's whose directory is gone.
node_id() { printf '%s' "$1" | sha256sum | cut -c1-8; }
set_names() { # state [id]
  state=$1 id=${2:-$(node_id "$1")}
  NETNS=cipnode-$id
  EXTNS=cipnode-$id-ext
}
set_names "$state"
node_dir() { if [ "$1" = 1 ]; then echo "$state"; else echo "$state/node-$1"; fi; }
node_netns() { if [ "$1" = 1 ]; then echo "$NETNS"; else echo "cipnode$1-$id"; fi; }
# The workers this state dir has (their directories), in order: 2, 3.
present_workers() {
  local n
  for ((n = 2; n <= MAX_WORKERS + 1; n++)); do [ -d "$(node_dir "$n")" ] && echo $n; done
  return 0
}

in_node() { ip netns exec "$NETNS" "$@"; }
kubectl_bin() { eval "$("$builder" print-dirs)"; echo "$K8S_BIN/kubectl"; }
kc() { in_node "$(kubectl_bin)" --kubeconfig "$state/admin.kubeconfig" "$@"; }

# A node's init: the process `unshare` forked (pid 1 of the node's pid namespace). $1: the
# node's dir (default: the first node's, the state dir).
init_pid() {
  local dir=${1:-$state} u c
  u=$(cat "$dir/unshare.pid" 2>/dev/null) || return 1
  [[ $u =~ ^[0-9]+$ ]] && pid_alive "$u" || return 1
  # (The trailing space: a worker's dir begins with the first node's.)
  { tr '\0' ' ' < "/proc/$u/cmdline"; } 2>/dev/null | grep -qF -- "node-init.sh $dir " || return 1
  c=$(cat "/proc/$u/task/$u/children" 2>/dev/null | awk '{print $1}')
  [ -n "$c" ] && echo "$c"
}

# ---------------------------------------------------------------- cgroups
# The node's cgroup: <the memory cgroup this shell is in>/clusterip-node-<id>, the same path
# in every v1 hierarchy (kubelet's cgroupRoot names one path for all); each worker's beside it,
# clusterip-node-<id>-<n>, with a limit of its own. Which directories this made is recorded in
# <node dir>/cgroup-dirs, so `down` removes those and nothing else.
CGROUP_ROOT=/sys/fs/cgroup
cgroup_hierarchies() {
  local d
  for d in "$CGROUP_ROOT"/*; do
    [ -f "$d/cgroup.procs" ] || continue
    [ "${d##*/}" = unified ] && continue
    echo "$d"
  done
}
node_cgroup() { # [suffix]
  local cur; cur=$(cgroup_of memory) || cur=/
  cur=${cur%/}
  echo "$cur/clusterip-node-$id${1:-}"
}
make_cgroups() { # cgroup memory-limit node-dir
  local cg=$1 limit=$2 dirs=$3/cgroup-dirs h p part
  : > "$dirs"
  while IFS= read -r h; do
    p=$h
    for part in $(echo "$cg/system" | tr '/' ' '); do
      p=$p/$part
      if [ ! -d "$p" ]; then
        mkdir "$p"
        echo "$p" >> "$dirs"
      fi
      if [ "${h##*/}" = cpuset ]; then
        [ -s "$p/cpuset.cpus" ] || cat "${p%/*}/cpuset.cpus" > "$p/cpuset.cpus"
        [ -s "$p/cpuset.mems" ] || cat "${p%/*}/cpuset.mems" > "$p/cpuset.mems"
      fi
    done
  done < <(cgroup_hierarchies)
  echo "$limit" | numfmt --from=iec > "$CGROUP_ROOT/memory$cg/memory.limit_in_bytes"
}
# Kill what is left in the node's cgroups (pids hierarchy: every task of the node is there),
# then remove the directories: kubelet's (kubepods/…) deepest first, then ours.
remove_cgroups() { # cgroup node-dir
  local cg=$1 dirs=$2/cgroup-dirs h d rc=0
  [ -d "$CGROUP_ROOT/pids$cg" ] && { kill_cgroup_tree "$CGROUP_ROOT/pids$cg" "node-cluster: cgroup:" >&2 || rc=1; }
  # (kubelet and runc also make the same paths in the cgroup v2 hierarchy, empty, when it is
  # mounted beside v1 — hybrid mode.)
  while IFS= read -r h; do
    [ -d "$h$cg" ] && find "$h$cg" -depth -type d -exec rmdir {} + 2>/dev/null
  done < <(cgroup_hierarchies; [ -d "$CGROUP_ROOT/unified" ] && echo "$CGROUP_ROOT/unified")
  if [ -f "$dirs" ]; then
    while IFS= read -r d; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done < <(tac "$dirs")
  fi
  while IFS= read -r h; do [ -d "$h$cg" ] && { log "could not remove $h$cg"; rc=1; }; done < <(cgroup_hierarchies)
  return $rc
}

# ---------------------------------------------------------------- certificates, configs
sign() { # name subject [ext lines]
  local name=$1 subj=$2 ext=${3:-}
  openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf '%b' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
gen_pki() {
  mkdir -p "$state/pki"
  ( cd "$state/pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=clusterip-node-ca" -keyout ca.key -out ca.crt 2>/dev/null
    sign apiserver /CN=kube-apiserver "subjectAltName = DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local, DNS:localhost, IP:$NODE_IP, IP:$APISERVER_VIP, IP:127.0.0.1\nextendedKeyUsage = serverAuth\n"
    sign admin "/O=system:masters/CN=clusterip-node-admin" "extendedKeyUsage = clientAuth\n"
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage = clientAuth\n"
    sign kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "extendedKeyUsage = clientAuth\n"
    sign kubelet-serving "/CN=$NODE_NAME" "subjectAltName = DNS:$NODE_NAME, IP:$NODE_IP\nextendedKeyUsage = serverAuth\n"
    # Each worker's kubelet: its own identity in system:nodes (the Node authorizer and
    # NodeRestriction let it touch its own Node and pods only) and a serving certificate
    # for its own address (the kube-apiserver connects to it for logs and exec).
    local n name ip
    for ((n = 2; n <= NODES; n++)); do
      name=$(node_name "$n") ip=$(node_ip "$n")
      sign "kubelet-$n" "/O=system:nodes/CN=system:node:$name" "extendedKeyUsage = clientAuth\n"
      sign kubelet-$n-serving "/CN=$name" "subjectAltName = DNS:$name, IP:$ip\nextendedKeyUsage = serverAuth\n"
    done
    sign kube-controller-manager /CN=system:kube-controller-manager "extendedKeyUsage = clientAuth\n"
    sign kube-scheduler /CN=system:kube-scheduler "extendedKeyUsage = clientAuth\n"
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    rm -f ca.srl )
  # The webhook's certificates, by the documented script: the kube-apiserver's half
  # (AdmissionConfiguration + kubeconfig with its client certificate) is in place before it
  # starts; `deploy` runs the script again with --apply (same CAs, so both halves agree).
  "$repo/scripts/gen-webhook-certs.sh" --dir "$state/webhook-certs" \
    --apiserver-config-dir "$state/webhook-certs/apiserver" >/dev/null 2>"$state/logs/gen-webhook-certs.log" ||
    { cat "$state/logs/gen-webhook-certs.log" >&2; die "scripts/gen-webhook-certs.sh failed"; }
}
kubeconfig() { # file user (the certificate pki/<user>.crt)
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: node
  cluster: {server: "https://$NODE_IP:6443", certificate-authority: "$state/pki/ca.crt"}
users:
- name: $2
  user: {client-certificate: "$state/pki/$2.crt", client-key: "$state/pki/$2.key"}
contexts:
- name: node
  context: {cluster: node, user: $2}
current-context: node
EOF
}
write_configs() {
  local u
  for u in admin kubelet kube-controller-manager kube-scheduler; do kubeconfig "$state/$u.kubeconfig" "$u"; done
}
# One node's files, in its dir (the state dir for the first node, <state>/node-<n> for
# worker n), read by scripts/lib/node-init.sh there.
write_node_configs() { # dir role name ip pod-range cgroup kubelet-cert logs
  local dir=$1 role=$2 name=$3 ip=$4 pod_range=$5 cg=$6 cert=$7 logs=$8
  eval "$("$builder" print-dirs)"
  mkdir -p "$dir"
  cat > "$dir/node.env" <<EOF
ROLE=$role
LOGS=$logs
NODE_NAME=$name
NODE_IP=$ip
SERVICE_CIDR=$SERVICE_CIDR
PROXY=$PROXY
ETCD_CLIENT_URLS=http://127.0.0.1:2379$([ "$BACKEND" = etcd ] && echo ",http://$NODE_IP:2379")
K8S_BIN=$K8S_BIN
ETCD_BIN=$ETCD_BIN
CONTAINERD_BIN=$CONTAINERD_BIN
IMAGES_DIR=$repo/target/images
EOF
  mkdir -p "$dir/cni/net.d" "$logs"
  # ptp, not bridge: every pod has its own veth and /32 route, so all pod traffic (pod to
  # pod too) is routed through the node's IP layer, where the Service rules are. A bridge
  # would need br_netfilter for a pod reaching another pod through a ClusterIP, and loading
  # it would change the machine's root network namespace too.
  cat > "$dir/cni/net.d/10-node.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "clusterip-node",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "mtu": 1500,
     "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam",
              "ranges": [[{"subnet": "$pod_range"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  # CAP_SYS_RESOURCE is bit 24 of the effective set.
  local RESTRICT_OOM=false
  (( (0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 24) & 1 )) || RESTRICT_OOM=true
  # (/run is the node's own tmpfs: the same socket and state paths on every node.)
  cat > "$dir/containerd.toml" <<EOF
version = 3
root = "$dir/containerd"
state = "/run/containerd/state"
[grpc]
  address = "/run/containerd/containerd.sock"
[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "registry.k8s.io/pause:$K8S_VERSION"
[plugins."io.containerd.cri.v1.runtime"]
  # This machine withholds CAP_SYS_RESOURCE even from root: an oom_score_adj below
  # containerd's own (kubelet asks -998 for sandboxes) would fail every container start.
  restrict_oom_score_adj = $RESTRICT_OOM
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$dir/cni/net.d"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
EOF
  # kubelet on this machine: cgroup v1 only (failCgroupV1: false; v1 is in maintenance and
  # refused by default), no systemd (cgroupfs driver), a cgroup root of the node's own.
  cat > "$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: $cg
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: $ip
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $state/pki/$cert-serving.crt
tlsPrivateKeyFile: $state/pki/$cert-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
# No DNS server for pods unless CLUSTERIP_NODE_DNS=1 (then the cluster DNS of "dns"), and no
# query leaves the node for the machine's resolver: tests reach Services by ClusterIP.
# kube-apiserver reaches kubelet by its InternalIP.
resolvConf: ""
$(if [ "${CLUSTERIP_NODE_DNS:-0}" = 1 ]; then echo "clusterDNS: [$CLUSTER_DNS_IP]"; fi)
failSwapOn: false
protectKernelDefaults: false
podLogsDir: /var/log/pods
maxPods: 60
serializeImagePulls: false
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
EOF
  [ "$dir" = "$state" ] || kubeconfig "$dir/kubelet.kubeconfig" "$cert"
}

# ---------------------------------------------------------------- network namespaces
# The nodes' link is a bridge in the outside namespace (the LAN's switch, the outside's own
# address on it) with one veth a node; a bridge there needs no br_netfilter: no Service rule
# lives in the outside namespace, only in the nodes', where every packet is routed.
make_netns() {
  ip netns add "$EXTNS"
  ip -n "$EXTNS" link set lo up
  ip -n "$EXTNS" link add lan0 type bridge
  # (Where br_netfilter is loaded, frames crossing a bridge go through the namespace's
  # netfilter hooks; this one is a plain switch: no hooks, in this namespace only.)
  local k
  for k in iptables ip6tables arptables; do
    [ ! -e "/proc/sys/net/bridge/bridge-nf-call-$k" ] ||
      ip netns exec "$EXTNS" sysctl -qw "net.bridge.bridge-nf-call-$k=0" 2>/dev/null || true
  done
  ip -n "$EXTNS" addr add "$EXT_IP/24" dev lan0
  ip -n "$EXTNS" link set lan0 up
  # (The veth's name in the node's namespace until it is renamed eth0: n<id>, w<id>, w3<id>.)
  local n m veth
  for ((n = 1; n <= NODES; n++)); do
    case $n in 1) veth=n$id ;; 2) veth=w$id ;; *) veth=w$n$id ;; esac
    attach_node "$(node_netns "$n")" "$(node_ip "$n")" "$veth" "node$n"
  done
  # Each node's part of the pod network through that node (kubelet's ptp routes only its
  # own pods): pod to pod across nodes without encapsulation, as a flat L2 does.
  for ((n = 1; n <= NODES; n++)); do
    for ((m = 1; m <= NODES; m++)); do
      [ $m = $n ] || ip -n "$(node_netns "$n")" route add "$(node_pod_range "$m")" via "$(node_ip "$m")"
    done
  done
}
attach_node() { # netns address veth-name port-name (in the outside namespace)
  local ns=$1 addr=$2 veth=$3 port=$4
  ip netns add "$ns"
  ip link add "$veth" netns "$ns" type veth peer name "$port" netns "$EXTNS"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$veth" name eth0
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$EXT_IP"
  ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.route_localnet=1
  ip -n "$EXTNS" link set "$port" master lan0
  ip -n "$EXTNS" link set "$port" up
}
remove_netns() {
  local ns p rc=0 deadline
  local n nss=()
  # (Every worker namespace this id can have, whatever CLUSTERIP_NODE_WORKERS says now.)
  for ((n = MAX_WORKERS + 1; n >= 2; n--)); do nss+=("$(node_netns "$n")"); done
  for ns in "${nss[@]}" "$NETNS" "$EXTNS"; do
    [ -e "/run/netns/$ns" ] || continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do
      log "netns $ns: killing $(proc_desc "$p")"; kill -KILL "$p" 2>/dev/null || true
    done
    # (The nodes' mount namespaces hold copies of these mounts; the delete can fail with
    # EBUSY until the last of a node's processes is gone, a moment after it was killed.)
    deadline=$((SECONDS + 10))
    until ip netns delete "$ns" 2>/dev/null || [ ! -e "/run/netns/$ns" ]; do
      [ $SECONDS -lt $deadline ] || { log "could not delete netns $ns"; rc=1; break; }
      sleep 0.2
    done
  done
  return $rc
}

# ---------------------------------------------------------------- registry of nodes
register() {
  ( flock 8
    { grep -vxF "$state" "$registry" 2>/dev/null || true; echo "$state"; } > "$registry.$$"
    mv "$registry.$$" "$registry" ) 8>"$registry.lock"
}
unregister() {
  ( flock 8
    [ -f "$registry" ] || exit 0
    { grep -vxF "$state" "$registry" || true; } > "$registry.$$"
    mv "$registry.$$" "$registry" ) 8>"$registry.lock"
}

# ---------------------------------------------------------------- commands
cmd_up() {
  cmd_reap >&2 || log "reap reported errors (above); going on"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, cgroups, mounts)"
  [ "${CLUSTERIP_PACKAGES_ENSURED:-}" = 1 ] ||
    "$repo/scripts/lib/ensure-packages.sh" runc iproute2 openssl curl util-linux nftables iptables conntrack
  local owner=""
  if [ -n "${CLUSTERIP_OWNER_PID:-}" ]; then
    owner=$(owner_of "$CLUSTERIP_OWNER_PID") || die "CLUSTERIP_OWNER_PID=$CLUSTERIP_OWNER_PID: no such process"
  fi
  if all_up; then log "already up"; return 0; fi
  cmd_down quiet
  local started=$SECONDS
  "$builder" etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl containerd cni-plugins
  local img imgs=(clusterip clusterip-agent pause)
  [ "$PROXY" = kube-proxy ] && imgs+=(kube-proxy)
  # (CLUSTERIP_NODE_BUILD_IMAGES=0: import whatever target/images holds, build nothing.)
  if [ "${CLUSTERIP_NODE_BUILD_IMAGES:-1}" != 0 ]; then
    for img in "${imgs[@]}"; do
      [ -f "$repo/target/images/$img.oci.tar" ] || "$repo/scripts/build-images.sh" "$img"
    done
  fi
  [ "$PROXY" != kube-proxy ] || [ -f "$repo/target/images/kube-proxy.oci.tar" ] ||
    die "CLUSTERIP_NODE_PROXY=kube-proxy: no target/images/kube-proxy.oci.tar (scripts/build-images.sh kube-proxy)"
  mkdir -p "$state"
  [ -z "$owner" ] || echo "$owner" > "$state/owner"
  register
  trap 'rc=$?; if [ $rc -ne 0 ]; then log "start failed; removing the node (logs were in $state/logs)"; cp -r "$state/logs" "${TMPDIR:-/tmp}/cipnode-failed-logs" 2>/dev/null || true; cmd_down quiet; fi' EXIT
  local cg n dir
  cg=$(node_cgroup)
  echo "$cg" > "$state/cgroup"
  mkdir -p "$state/logs"
  gen_pki
  write_configs
  write_node_configs "$state" control-plane "$NODE_NAME" "$NODE_IP" "$NODE_POD_RANGE" "$cg" kubelet "$state/logs"
  for ((n = 2; n <= NODES; n++)); do
    dir=$(node_dir "$n")
    write_node_configs "$dir" worker "$(node_name "$n")" "$(node_ip "$n")" "$(node_pod_range "$n")" \
      "$(node_cgroup "-$n")" "kubelet-$n" "$state/logs/node-$n"
    node_cgroup "-$n" > "$dir/cgroup"
  done
  make_netns
  make_cgroups "$cg" "$MEMORY_LIMIT" "$state"
  log "starting the node ($NETNS; cgroup $cg; memory limit $MEMORY_LIMIT)"
  start_init "$state" "$cg" "$NETNS"
  for ((n = 2; n <= NODES; n++)); do
    dir=$(node_dir "$n") cg=$(node_cgroup "-$n")
    make_cgroups "$cg" "$WORKER_MEMORY_LIMIT" "$dir"
    log "starting the worker node $(node_name "$n") ($(node_netns "$n"); cgroup $cg; memory limit $WORKER_MEMORY_LIMIT)"
    start_init "$dir" "$cg" "$(node_netns "$n")"
  done
  for ((n = 1; n <= NODES; n++)); do wait_init "$(node_dir "$n")"; done
  local names=()
  for ((n = 1; n <= NODES; n++)); do names+=("$(node_name "$n")"); done
  log "waiting for node(s) ${names[*]} to be Ready"
  local deadline=$((SECONDS + 180)) m
  for ((n = 1; n <= NODES; n++)); do
    until node_ready "$(node_name "$n")"; do
      for ((m = 1; m <= NODES; m++)); do
        init_pid "$(node_dir "$m")" >/dev/null || die "node $(node_name "$m")'s init exited (logs: $(node_logs "$m"))"
      done
      [ $SECONDS -lt $deadline ] || { kc get nodes >&2 || true; die "node $(node_name "$n") not Ready after 180s (logs: $state/logs)"; }
      sleep 1
    done
  done
  # (Pods can be made once the controller-manager has made the default ServiceAccount.)
  kc_until 60 get serviceaccount default || die "no ServiceAccount default/default after 60s"
  [ "$PROXY" != kube-proxy ] || apply_kube_proxy
  trap - EXIT
  log "up in $((SECONDS - started))s: node(s) ${names[*]} Ready ($PROXY as the Service proxy)"
  log "use it: scripts/node-cluster.sh kubectl get nodes   (or: ip netns exec $NETNS kubectl --kubeconfig $state/admin.kubeconfig …)"
}

# Up already: every node CLUSTERIP_NODE_WORKERS asks for runs and is Ready, and no other.
all_up() {
  local n
  for ((n = 1; n <= MAX_WORKERS + 1; n++)); do
    if [ $n -le $NODES ]; then
      init_pid "$(node_dir "$n")" >/dev/null && node_ready "$(node_name "$n")" || return 1
    else
      [ ! -d "$(node_dir "$n")" ] || return 1
    fi
  done
}
node_logs() { if [ "$1" = 1 ]; then echo "$state/logs"; else echo "$state/logs/node-$1"; fi; }

# This subshell joins the node's cgroups, then becomes `unshare`, whose child is the node's
# init (pid 1 of a new pid namespace, in a new mount namespace, in the node's network).
start_init() { # node-dir cgroup netns
  local dir=$1 cg=$2 ns=$3 logs
  logs=$(sed -n 's/^LOGS=//p' "$dir/node.env")
  ( for h in $(cgroup_hierarchies); do echo $BASHPID > "$h$cg/system/cgroup.procs"; done
    exec setsid nsenter --net="/run/netns/$ns" \
      unshare --mount --propagation private --pid --fork --mount-proc --kill-child=KILL \
      bash "$repo/scripts/lib/node-init.sh" "$dir" ) > "$logs/node-init.log" 2>&1 < /dev/null 9>&- 8>&- &
  echo $! > "$dir/unshare.pid"
}
wait_init() { # node-dir
  local dir=$1 logs deadline=$((SECONDS + 300))
  logs=$(sed -n 's/^LOGS=//p' "$dir/node.env")
  until [ -f "$dir/init-ready" ]; do
    pid_alive "$(cat "$dir/unshare.pid")" || { tail -n 20 "$logs/node-init.log" >&2; die "the node's init exited during start-up (logs: $logs)"; }
    [ $SECONDS -lt $deadline ] || { tail -n 20 "$logs/node-init.log" >&2; die "the node's processes did not start in 300s (logs: $logs)"; }
    sleep 0.5
  done
}

node_ready() { # [node name]
  [ -f "$state/admin.kubeconfig" ] || return 1
  kc get node "${1:-$NODE_NAME}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}

# kube-proxy as a DaemonSet (tests/node/kube-proxy.yaml), Ready on every node. Its image is
# imported into each node's containerd at start (target/images/kube-proxy.oci.tar).
apply_kube_proxy() {
  local image=registry.k8s.io/kube-proxy:v$K8S_VERSION nodes ready manifest
  manifest=$(KUBE_PROXY_IMAGE=$image APISERVER=https://$NODE_IP:6443 CLUSTER_CIDR=$POD_CIDR \
    envsubst '$KUBE_PROXY_IMAGE $APISERVER $CLUSTER_CIDR' < "$repo/tests/node/kube-proxy.yaml")
  # (The runtime would make a missing hostPath directory on the machine's own filesystem:
  # nftables mode loads no module, so without /lib/modules the mount is left out.)
  [ -d /lib/modules ] || manifest=$(grep -v 'name: lib-modules' <<< "$manifest")
  kc apply -f - <<< "$manifest" >&2
  kc -n kube-system rollout status daemonset/kube-proxy --timeout=120s >&2 ||
    die "kube-proxy DaemonSet not rolled out in 120s"
  nodes=$(kc get nodes -o name | wc -l)
  ready=$(kc -n kube-system get daemonset kube-proxy -o jsonpath='{.status.numberReady}')
  [ "$ready" = "$nodes" ] || die "kube-proxy Ready on $ready node(s) of $nodes"
  log "kube-proxy (DaemonSet, $image) Ready on $ready node(s)"
}

# Wait until `kubectl $@` succeeds, or fail after $1 seconds.
kc_until() {
  local secs=$1; shift
  local deadline=$((SECONDS + secs))
  until kc "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { kc "$@" >&2 || true; return 1; }
    sleep 1
  done
}

# deploy/, as a user applies it, through an overlay that sets what differs per cluster:
# clusterip's range (a part of this node's Service range) and its address block size, the pod CIDR in the network
# policy, the images' tag (dev, built by scripts/build-images.sh) and the apiserver endpoint
# the agent uses (it cannot reach the apiserver through a ClusterIP it has yet to program).
# The etcd backend (CLUSTERIP_NODE_BACKEND=etcd): the node's etcd, as operations.md says to
# point --etcd-endpoints at one the pods reach, without --use-servicecidrs (the etcd backend
# serves --service-cidr only). (args/1 is deploy/'s --backend=ipaddress, args/15 its
# --use-servicecidrs: the test op fails the patch if that moved.)
deploy_backend_patch() {
  [ "$BACKEND" = etcd ] || return 0
  cat <<EOF
  - target: {kind: Deployment, name: clusterip-controller}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args/1
        value: --backend=etcd
      - op: test
        path: /spec/template/spec/containers/0/args/15
        value: --use-servicecidrs
      - op: remove
        path: /spec/template/spec/containers/0/args/15
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --etcd-endpoints=http://$NODE_IP:2379
EOF
}

# CLUSTERIP_NODE_AGENT_ON=labelled: the agent's DaemonSet only on labelled nodes.
deploy_agent_patch() {
  [ "$AGENT_ON" = labelled ] || return 0
  cat <<EOF
  - target: {kind: DaemonSet, name: clusterip-agent}
    patch: |
      - op: add
        path: /spec/template/spec/nodeSelector/clusterip.allocator~1service-proxy
        value: clusterip-agent
EOF
}

cmd_deploy() {
  init_pid >/dev/null || die "no node running in $state ('$0 up' first)"
  if [ "$BACKEND" = etcd ]; then
    grep -q "^ETCD_CLIENT_URLS=.*$NODE_IP" "$state/node.env" ||
      die "CLUSTERIP_NODE_BACKEND=etcd: this node's etcd serves no client on $NODE_IP (bring it up with CLUSTERIP_NODE_BACKEND=etcd)"
  fi
  local certs=(nsenter --net="/run/netns/$NETNS" env PATH="$(dirname "$(kubectl_bin)"):$PATH"
    "$repo/scripts/gen-webhook-certs.sh" --dir "$state/webhook-certs"
    --apiserver-config-dir "$state/webhook-certs/apiserver" --kubeconfig "$state/admin.kubeconfig" --apply)
  local overlay="$state/deploy"
  mkdir -p "$overlay"
  cat > "$overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(realpath --relative-to="$overlay" "$repo/deploy")
  - agent-apiserver.yaml
patches:
  - target: {kind: Deployment, name: clusterip-controller}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args/2
        value: --service-cidr=$CLUSTERIP_CIDR
      # (No --address-block-size: the default cuts the /25 into 8-address blocks, and a
      # replica whose blocks are used up is handed one over: docs/backends.md.)
$(deploy_backend_patch)
$(deploy_agent_patch)
  - target: {kind: NetworkPolicy, name: clusterip-controller}
    patch: |
      - op: replace
        path: /spec/ingress/0/from/0/ipBlock/except
        value: ["$POD_CIDR"]
images:
  - {name: clusterip, newName: clusterip, newTag: dev}
  - {name: clusterip-agent, newName: clusterip-agent, newTag: dev}
EOF
  cat > "$overlay/agent-apiserver.yaml" <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: clusterip-agent-apiserver
  namespace: kube-system
data:
  host: "$NODE_IP"
  port: "6443"
EOF
  # The install order of docs/operations.md: certificates, everything but the webhook
  # registrations, wait for the pods, the registrations, then their caBundle.
  "${certs[@]}" 2>"$state/logs/gen-webhook-certs.log" || { cat "$state/logs/gen-webhook-certs.log" >&2; die "scripts/gen-webhook-certs.sh --apply failed"; }
  kc apply -k "$overlay" -l 'app.kubernetes.io/component!=admission-registration' >&2
  log "waiting for the agent DaemonSet and the controller Deployment"
  kc -n kube-system rollout status daemonset/clusterip-agent --timeout=180s >&2
  if [ "$AGENT_ON" = labelled ]; then
    log "clusterip-agent runs on nodes labelled clusterip.allocator/service-proxy=clusterip-agent only"
  else
    # (rollout status counts the pods the DaemonSet wants; with a worker that must be one a node.)
    local nodes ready
    nodes=$(kc get nodes -o name | wc -l)
    ready=$(kc -n kube-system get daemonset clusterip-agent -o jsonpath='{.status.numberReady}')
    [ "$ready" = "$nodes" ] || die "clusterip-agent Ready on $ready node(s) of $nodes"
    log "clusterip-agent Ready on $ready of $nodes node(s)"
  fi
  kc -n clusterip-system rollout status deployment/clusterip-controller --timeout=240s >&2
  kc apply -k "$overlay" >&2
  "${certs[@]}" 2>>"$state/logs/gen-webhook-certs.log" || { cat "$state/logs/gen-webhook-certs.log" >&2; die "scripts/gen-webhook-certs.sh --apply failed"; }
  log "deployed: $(kc -n clusterip-system get deployment clusterip-controller -o jsonpath='{.status.readyReplicas}') controller replicas ready (backend $BACKEND)"
}

# CoreDNS as the cluster DNS (the e2e suite resolves Service names), as kubeadm installs it.
cmd_dns() {
  init_pid >/dev/null || die "no node running in $state ('$0 up' first)"
  grep -q '^clusterDNS:' "$state/kubelet.yaml" || die "this node's kubelet has no clusterDNS (bring it up with CLUSTERIP_NODE_DNS=1)"
  local image=registry.k8s.io/coredns/coredns:v$COREDNS_VERSION
  CLUSTER_DNS_IP=$CLUSTER_DNS_IP COREDNS_IMAGE=$image envsubst '$CLUSTER_DNS_IP $COREDNS_IMAGE' \
    < "$repo/tests/node/coredns.yaml" | kc apply -f - >&2
  kc -n kube-system rollout status deployment/coredns --timeout=180s >&2
  log "cluster DNS: CoreDNS v$COREDNS_VERSION at $CLUSTER_DNS_IP"
}

cmd_load_images() {
  local dir=${1:-$repo/target/images} pid pids=() img
  pid=$(init_pid) || die "no node running in $state"
  pids+=("$pid")
  local n
  for n in $(present_workers); do
    pid=$(init_pid "$(node_dir "$n")") || die "worker node $(node_name "$n")'s init is not running ($(node_dir "$n"))"
    pids+=("$pid")
  done
  eval "$("$builder" print-dirs)"
  for img in "$dir"/*.oci.tar; do
    [ -f "$img" ] || die "no image archive in $dir"
    for pid in "${pids[@]}"; do
      nsenter -t "$pid" -m -n "$CONTAINERD_BIN/ctr" --address /run/containerd/containerd.sock -n k8s.io \
        images import --no-unpack --local "$img" >&2
    done
  done
}

# Stop a node's init: SIGTERM (it stops its children), then SIGKILL of its `unshare` parent,
# which kills the whole pid namespace.
stop_init() { # node-dir [quiet]
  local dir=$1 pid u
  if pid=$(init_pid "$dir"); then
    [ "${2:-}" = quiet ] || log "stopping the node in $dir (init pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  u=$(cat "$dir/unshare.pid" 2>/dev/null || true)
  if [[ $u =~ ^[0-9]+$ ]] && { tr '\0' ' ' < "/proc/$u/cmdline"; } 2>/dev/null | grep -qF -- "node-init.sh $dir "; then
    # (unshare leaves once its child has; killing it kills the whole pid namespace.)
    for _ in $(seq 1 50); do pid_alive "$u" || break; sleep 0.1; done
    kill -KILL "$u" 2>/dev/null || true
    for _ in $(seq 1 50); do pid_alive "$u" || break; sleep 0.1; done
  fi
}

# The workers first, last first (their kubelets talk to the first node's apiserver), then
# the first node; then their cgroups, the namespaces, the state dir (the workers' are inside it).
cmd_down() {
  local cg n dir
  for n in $(present_workers | sort -rn); do
    dir=$(node_dir "$n")
    stop_init "$dir" "${1:-}"
    cg=$(cat "$dir/cgroup" 2>/dev/null || node_cgroup "-$n")
    remove_cgroups "$cg" "$dir" || true
  done
  stop_init "$state" "${1:-}"
  cg=$(cat "$state/cgroup" 2>/dev/null || node_cgroup)
  remove_cgroups "$cg" "$state" || true
  remove_netns || true
  unregister
  if [ -d "$state" ]; then
    # (Nothing is mounted under it any more: the node's mounts lived in its mount namespace.)
    rm -rf --one-file-system "$state"
    [ "${1:-}" = quiet ] || log "stopped; removed $state"
  fi
}

node_status() { # node-dir name: one node's init, processes and Ready condition
  local dir=$1 name=$2 pid ok=0 pname npid
  if pid=$(init_pid "$dir"); then echo "$name init: running (pid $pid)"
  else echo "$name init: not running"; return 2; fi
  while read -r pname npid; do
    if nsenter -t "$pid" -p -m -- kill -0 "$npid" 2>/dev/null; then echo "$name $pname: running"; else echo "$name $pname: not running"; ok=1; fi
  done < "$dir/node-pids"
  if node_ready "$name"; then echo "node $name: Ready"; else echo "node $name: NOT Ready"; ok=1; fi
  return $ok
}

cmd_status() {
  local ok=0
  local n workers=
  for n in $(present_workers); do workers+=", worker $(node_netns "$n")"; done
  echo "netns $NETNS$workers, outside $EXTNS"
  node_status "$state" "$NODE_NAME" || ok=$?
  [ "$ok" = 2 ] && return 1
  for n in $(present_workers); do node_status "$(node_dir "$n")" "$(node_name "$n")" || ok=1; done
  if [ -f "$state/owner" ]; then
    local opid ostart; read -r opid ostart < "$state/owner"
    if owner_alive "$opid" "$ostart"; then echo "owner: pid $opid (running)"; else echo "owner: pid $opid (gone: 'reap' removes this node)"; ok=1; fi
  fi
  return $ok
}

# Nodes whose owner is gone (registry + the default dir), and cipnode-* namespaces whose node
# is gone (its directory removed, or its init dead with no directory to say whose it was).
cmd_reap() {
  local dirs=() d ns nid live=" "
  [ -f "$registry" ] && mapfile -t dirs < "$registry"
  dirs+=("$repo/.node")
  for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do
    [ -d "$d" ] || continue
    live+="$(node_id "$d") "
    [ -f "$d/owner" ] || continue
    owner_file_alive "$d/owner" && continue
    ( set_names "$d"
      cmd_down quiet
      echo "reap: removed node $d (owner gone)" )
    live=${live/ $(node_id "$d") / }
  done
  for ns in /run/netns/cipnode-* /run/netns/cipnode[0-9]-*; do
    [ -e "$ns" ] || continue
    # (cipnode-<id>, cipnode-<id>-ext, the workers' cipnode<n>-<id>, and any cipnode-<id>-<name>.)
    nid=${ns##*/cipnode}; nid=${nid#[0-9]}; nid=${nid#-}; nid=${nid%%-*}
    [[ $live == *" $nid "* ]] && continue
    ( set_names /nonexistent "$nid"
      remove_netns && echo "reap: removed netns ${ns##*/} (its node is gone)" )
  done
  [ -f "$registry" ] && unregister_missing
  return 0
}
unregister_missing() {
  ( flock 8
    while read -r d; do [ -d "$d" ] && echo "$d"; done < "$registry" > "$registry.$$"
    mv "$registry.$$" "$registry" ) 8>"$registry.lock"
}

case "${1:-}" in
  up) cmd_up ;;
  deploy) cmd_deploy ;;
  down) cmd_down ;;
  status) cmd_status ;;
  reap) cmd_reap ;;
  kubectl) shift; kc "$@" ;;
  exec) shift; in_node "$@" ;;
  ext) shift; ip netns exec "$EXTNS" "$@" ;;
  dns) cmd_dns ;;
  load-images) shift; cmd_load_images "$@" ;;
  *) echo "usage: $0 up|deploy|down|status|reap|kubectl ARGS|exec CMD|ext CMD|dns|load-images [DIR]" >&2; exit 2 ;;
esac
