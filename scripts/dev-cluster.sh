#!/usr/bin/env bash
# The dev control plane: a real etcd and a real kube-apiserver on loopback.
#
#   scripts/dev-cluster.sh up       build (once, cached), start, wait for /readyz, print KUBECONFIG
#   scripts/dev-cluster.sh down     stop exactly what `up` started (pid files) and remove the state
#   scripts/dev-cluster.sh status   say what runs; exit 0 when everything is up and ready
#
# State lives in .cluster/ at the repository root (git-ignored), or in CLUSTERIP_CLUSTER_DIR.
# Binaries are built from Go modules into ${CLUSTERIP_CACHE:-~/.cache/clusterip}, keyed by the
# versions in scripts/versions.env (see scripts/lib/build-go-binaries.sh).
#
# Components are started in order and stopped in reverse order; each has a start_<name>
# function, a pid file and a readiness check. The clusterip controller joins the list later.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=${CLUSTERIP_CLUSTER_DIR:-$repo/.cluster}
builder="$repo/scripts/lib/build-go-binaries.sh"
# shellcheck source=versions.env
. "$repo/scripts/versions.env"

# The apiserver's own service ranges (both families; the first is the default family).
SERVICE_CIDRS=${CLUSTERIP_APISERVER_SERVICE_CIDRS:-198.19.0.0/16,fd00:10:96::/112}
COMPONENTS=(etcd kube-apiserver)

log() { echo "dev-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

bin_dirs() { eval "$("$builder" print-dirs)"; }

# ---------------------------------------------------------------- processes and pid files
pidfile() { echo "$state/$1.pid"; }

# The pid recorded for a component, if that process still runs the component's binary.
# A pid reused by an unrelated process is not ours and is never signalled.
live_pid() {
  local f; f=$(pidfile "$1")
  [ -f "$f" ] || return 1
  local pid; pid=$(cat "$f" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$(binary_of "$1")" || return 1
  echo "$pid"
}

binary_of() {
  bin_dirs
  case "$1" in
    etcd) echo "$ETCD_BIN/etcd" ;;
    kube-apiserver) echo "$K8S_BIN/kube-apiserver" ;;
    *) return 1 ;;
  esac
}

stop_component() {
  local name=$1 pid
  if pid=$(live_pid "$name"); then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name did not stop in 10s; killing"; kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$(pidfile "$name")"
}

# Start a command detached from this shell, in its own session, logging to $state/<name>.log.
spawn() {
  local name=$1; shift
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
  echo $! > "$(pidfile "$name")"
}

# ---------------------------------------------------------------- ports
port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }
pick_port() {
  local p=$1
  while ! port_free "$p"; do p=$((p + 1)); done
  echo "$p"
}

# ---------------------------------------------------------------- certificates
gen_certs() {
  local pki="$state/pki"
  mkdir -p "$pki"
  (
    cd "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=clusterip-dev-ca" \
      -keyout ca.key -out ca.crt 2>/dev/null
    # apiserver serving certificate: loopback names and the in-cluster names of the
    # kubernetes Service (its VIP is the first address of the apiserver's range).
    cat > apiserver.ext <<EOF
subjectAltName = DNS:localhost, DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local, IP:127.0.0.1, IP:::1, IP:198.19.0.1
extendedKeyUsage = serverAuth
EOF
    openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout apiserver.key -out apiserver.csr 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    # cluster-admin client certificate (group system:masters).
    printf 'extendedKeyUsage = clientAuth\n' > client.ext
    openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=clusterip-dev-admin" \
      -keyout admin.key -out admin.csr 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile client.ext -out admin.crt 2>/dev/null
    # service-account token signing key.
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    # a static bearer token for tools that prefer one (same rights as the admin cert).
    token=$(openssl rand -hex 24)
    echo "$token,clusterip-dev-admin,clusterip-dev-admin,system:masters" > tokens.csv
    echo "$token" > admin.token
    rm -f ./*.csr ./*.ext ./*.srl
  )
}

write_kubeconfig() {
  local pki="$state/pki"
  cat > "$state/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: clusterip-dev
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $pki/ca.crt
users:
- name: clusterip-dev-admin
  user:
    client-certificate: $pki/admin.crt
    client-key: $pki/admin.key
contexts:
- name: clusterip-dev
  context: {cluster: clusterip-dev, user: clusterip-dev-admin}
current-context: clusterip-dev
EOF
}

# ---------------------------------------------------------------- components
start_etcd() {
  mkdir -p "$state/etcd"
  spawn etcd "$ETCD_BIN/etcd" \
    --name clusterip-dev --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "clusterip-dev=http://127.0.0.1:$ETCD_PEER_PORT" \
    --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS_PORT" \
    --quota-backend-bytes 4294967296 --log-level warn
}
ready_etcd() { curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_METRICS_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }

start_kube-apiserver() {
  local pki="$state/pki"
  spawn kube-apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" --etcd-prefix /registry \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
    --endpoint-reconciler-type none \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-cluster-ip-range "$SERVICE_CIDRS" \
    --authorization-mode RBAC --allow-privileged \
    --enable-admission-plugins MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
    --disable-admission-plugins ServiceAccount \
    --profiling=false --v 1
}
ready_kube-apiserver() {
  local pki="$state/pki"
  curl -fsS --max-time 2 --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:$APISERVER_PORT/readyz" 2>/dev/null | grep -q '^ok$'
}

# kubectl supports an apiserver one minor away; build ours when the machine's is older.
kubectl_too_old() {
  command -v kubectl >/dev/null || return 0
  local minor
  minor=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1)
  [ -n "$minor" ] || return 0
  local want=${K8S_VERSION#1.}; want=${want%%.*}
  [ "$minor" -lt $((want - 1)) ]
}

wait_ready() {
  local name=$1 deadline=$((SECONDS + ${2:-120}))
  until "ready_$name"; do
    live_pid "$name" >/dev/null || { tail -n 30 "$state/$name.log" >&2 || true; die "$name exited during start-up (log: $state/$name.log)"; }
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$state/$name.log" >&2 || true; die "$name not ready after ${2:-120}s (log: $state/$name.log)"; }
    sleep 0.5
  done
}

load_ports() { [ -f "$state/ports.env" ] && . "$state/ports.env"; }

all_running() {
  local c
  for c in "${COMPONENTS[@]}"; do live_pid "$c" >/dev/null || return 1; done
  load_ports || return 1
  for c in "${COMPONENTS[@]}"; do "ready_$c" || return 1; done
}

# ---------------------------------------------------------------- commands
cmd_up() {
  bin_dirs
  if [ -d "$state" ] && all_running; then
    log "already up"
    echo "export KUBECONFIG=$state/kubeconfig"
    return 0
  fi
  # Anything left from a crashed or partial run is stopped and wiped before a fresh start.
  cmd_down quiet
  local extra=()
  kubectl_too_old && extra+=(kubectl)
  "$builder" etcd kube-apiserver "${extra[@]}"
  mkdir -p "$state"
  ETCD_PORT=$(pick_port "${CLUSTERIP_ETCD_PORT:-23790}")
  ETCD_PEER_PORT=$(pick_port $((ETCD_PORT + 10)))
  ETCD_METRICS_PORT=$(pick_port $((ETCD_PEER_PORT + 10)))
  APISERVER_PORT=$(pick_port "${CLUSTERIP_APISERVER_PORT:-26443}")
  cat > "$state/ports.env" <<EOF
ETCD_PORT=$ETCD_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
ETCD_METRICS_PORT=$ETCD_METRICS_PORT
APISERVER_PORT=$APISERVER_PORT
EOF
  gen_certs
  write_kubeconfig
  # What tests and tools read: endpoints of the parts, one KEY=value per line.
  cat > "$state/env" <<EOF
KUBECONFIG=$state/kubeconfig
CLUSTERIP_ETCD_ENDPOINTS=http://127.0.0.1:$ETCD_PORT
CLUSTERIP_APISERVER=https://127.0.0.1:$APISERVER_PORT
CLUSTERIP_APISERVER_SERVICE_CIDRS=$SERVICE_CIDRS
EOF
  # A failed start leaves nothing running (the log tail was already printed).
  trap 'rc=$?; if [ $rc -ne 0 ]; then log "start failed; stopping what was started"; cmd_down quiet; fi' EXIT
  local c
  for c in "${COMPONENTS[@]}"; do
    log "starting $c"
    "start_$c"
    wait_ready "$c" 120
    log "$c ready"
  done
  trap - EXIT
  echo "export KUBECONFIG=$state/kubeconfig"
}

cmd_down() {
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do stop_component "${COMPONENTS[$i]}"; done
  if [ -d "$state" ]; then
    rm -rf "$state"
    [ "${1:-}" = quiet ] || log "stopped; removed $state"
  elif [ "${1:-}" != quiet ]; then
    log "nothing to stop"
  fi
}

cmd_status() {
  local c pid ok=0
  load_ports || true
  for c in "${COMPONENTS[@]}"; do
    if pid=$(live_pid "$c"); then
      if "ready_$c" 2>/dev/null; then echo "$c: running (pid $pid), ready"
      else echo "$c: running (pid $pid), NOT ready"; ok=1; fi
    else
      echo "$c: not running"; ok=1
    fi
  done
  [ $ok -eq 0 ] && echo "export KUBECONFIG=$state/kubeconfig"
  return $ok
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
