#!/usr/bin/env bash
# The dev control plane: a real etcd, kube-apiserver and kube-controller-manager on loopback.
#
#   scripts/dev-cluster.sh up       build (once, cached), start, wait for /readyz, print KUBECONFIG
#   scripts/dev-cluster.sh down     stop exactly what `up` started (pid files) and remove the state
#   scripts/dev-cluster.sh status   say what runs; exit 0 when everything is up and ready
#   scripts/dev-cluster.sh stop C   stop one component (etcd, kube-apiserver,
#                                   kube-controller-manager; etcd-2, etcd-3, kube-apiserver-2
#                                   when started) of a running cluster
#   scripts/dev-cluster.sh start C  start it again with the same state, ports and flags
#                                   (fault tests use these two)
#   scripts/dev-cluster.sh reap     remove what runs whose owner is gone left behind: clusters,
#                                   processes (run cgroups), memory caps, network namespaces
#                                   cip<pid>x*, data dirs; one line per thing removed
#
# Owners: with CLUSTERIP_OWNER_PID=<pid> (scripts/test.sh sets its own pid, tests/support the
# test process's), `up` records that process (pid + start time) in <state>/owner and starts a
# watchdog that runs `down` as soon as the owner is gone (CLUSTERIP_WATCHDOG=0: no watchdog;
# `reap` still removes the cluster). Without it the cluster has no owner and lives until
# `down`. `up` reaps first. See docs/development.md.
#
# State lives in .cluster/ at the repository root (git-ignored), or in CLUSTERIP_CLUSTER_DIR.
# Binaries are built from Go modules into ${CLUSTERIP_CACHE:-~/.cache/clusterip}, keyed by the
# versions in scripts/versions.env (see scripts/lib/build-go-binaries.sh).
#
# Components are started in order and stopped in reverse order; each has a start_<name>
# function, a pid file and a readiness check. The clusterip controller joins the list later.
#
# kube-controller-manager runs as in a real control plane (its service-cidr-controller writes
# the ServiceCIDRs' finalizer and Ready condition beside ours, its namespace controller
# finalizes deleted namespaces, its endpointslice controller writes EndpointSlices).
#   CLUSTERIP_KCM=0           leave it out: the control plane of a cluster that runs
#                             clusterip's own ServiceCIDR reconciler alone (the test suite's
#                             private clusters do)
#
# Opt-in shapes for fault tests (the default is one etcd member and one apiserver):
#   CLUSTERIP_ETCD_MEMBERS=3  an etcd cluster of three members on loopback: etcd, etcd-2,
#                             etcd-3, each with its own data dir and ports; the apiserver
#                             and the controller are given every member's endpoint
#   CLUSTERIP_APISERVERS=2    a second kube-apiserver, kube-apiserver-2, on its own port with
#                             the same flags, PKI and etcd (CLUSTERIP_APISERVER_2 and
#                             KUBECONFIG_2 in the env file)
#   CLUSTERIP_APISERVER_2_ETCD_SERVERS=<urls>
#                             kube-apiserver-2's --etcd-servers instead of every member's
#                             (read each time it starts: `up`, `start kube-apiserver-2`):
#                             a fault test puts a delaying proxy on its path to etcd, so
#                             its watch cache lags (tests/controller_e2e/lagging_cache.rs)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=$(realpath -m "${CLUSTERIP_CLUSTER_DIR:-$repo/.cluster}")
builder="$repo/scripts/lib/build-go-binaries.sh"
# shellcheck source=versions.env
. "$repo/scripts/versions.env"
# shellcheck source=lib/owners.sh
. "$repo/scripts/lib/owners.sh"

# The apiserver's own service ranges (both families; the first is the default family).
SERVICE_CIDRS=${CLUSTERIP_APISERVER_SERVICE_CIDRS:-198.19.0.0/16,fd00:10:96::/112}
# Our own ranges: a strict subset of the apiserver's, so our choices are easy to tell apart.
CONTROLLER_CIDRS=${CLUSTERIP_SERVICE_CIDRS:-198.19.0.0/17,fd00:10:96::/113}
# The subject CN of the kube-apiserver's client certificate for webhooks: the one caller the
# clusterip webhook accepts.
WEBHOOK_CLIENT_NAME=kube-apiserver-webhook-client
# CLUSTERIP_CONTROLLER=0 leaves the clusterip controller out (the test suite starts its own).
ALL_COMPONENTS=(etcd etcd-2 etcd-3 kube-apiserver kube-apiserver-2 kube-controller-manager clusterip-controller)
ETCD_MEMBERS=${CLUSTERIP_ETCD_MEMBERS:-1}
APISERVERS=${CLUSTERIP_APISERVERS:-1}
KCM=${CLUSTERIP_KCM:-1}
# (A cluster already up keeps its shape: stop/start/status read it from its ports.env.)
[ -n "${CLUSTERIP_ETCD_MEMBERS:-}" ] || ! grep -qs '^ETCD_2_PORT=' "$state/ports.env" || ETCD_MEMBERS=3
[ -n "${CLUSTERIP_APISERVERS:-}" ] || ! grep -qs '^APISERVER_2_PORT=' "$state/ports.env" || APISERVERS=2
[ -n "${CLUSTERIP_KCM:-}" ] || [ ! -f "$state/ports.env" ] || grep -qs '^KCM_PORT=' "$state/ports.env" || KCM=0
case "$ETCD_MEMBERS" in 1|3) ;; *) echo "dev-cluster: error: CLUSTERIP_ETCD_MEMBERS=$ETCD_MEMBERS: 1 or 3" >&2; exit 2 ;; esac
case "$APISERVERS" in 1|2) ;; *) echo "dev-cluster: error: CLUSTERIP_APISERVERS=$APISERVERS: 1 or 2" >&2; exit 2 ;; esac
case "$KCM" in 0|1) ;; *) echo "dev-cluster: error: CLUSTERIP_KCM=$KCM: 0 or 1" >&2; exit 2 ;; esac
COMPONENTS=(etcd)
[ "$ETCD_MEMBERS" = 1 ] || COMPONENTS+=(etcd-2 etcd-3)
COMPONENTS+=(kube-apiserver)
[ "$APISERVERS" = 1 ] || COMPONENTS+=(kube-apiserver-2)
[ "$KCM" = 0 ] || COMPONENTS+=(kube-controller-manager)
[ "${CLUSTERIP_CONTROLLER:-1}" = 0 ] || COMPONENTS+=(clusterip-controller)

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
    etcd|etcd-[23]) echo "$ETCD_BIN/etcd" ;;
    kube-apiserver|kube-apiserver-2) echo "$K8S_BIN/kube-apiserver" ;;
    kube-controller-manager) echo "$K8S_BIN/kube-controller-manager" ;;
    clusterip-controller) controller_bin ;;
    *) return 1 ;;
  esac
}

# The clusterip binary the controller runs: CLUSTERIP_CONTROLLER_BIN when given (a test's
# own build; nothing is built, and the state directory keeps the path for stop, start and
# down), else cargo's build of CLUSTERIP_PROFILE in CARGO_TARGET_DIR (built at each start).
controller_bin() {
  if [ -n "${CLUSTERIP_CONTROLLER_BIN:-}" ]; then echo "$CLUSTERIP_CONTROLLER_BIN"
  elif [ -f "$state/clusterip-controller.bin" ]; then cat "$state/clusterip-controller.bin"
  else echo "${CARGO_TARGET_DIR:-$repo/target}/${CLUSTERIP_PROFILE:-debug}/clusterip"; fi
}

stop_component() {
  local name=$1 pid
  # Unregister the webhook first, or the apiserver refuses every Service meanwhile.
  [ "$name" = clusterip-controller ] && live_pid kube-apiserver >/dev/null && unregister_webhooks
  if pid=$(live_pid "$name"); then
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    # (A process a fault test stopped with SIGSTOP acts on the TERM only once continued.)
    kill -CONT "$pid" 2>/dev/null || true
    # (The controller drains: --shutdown-delay-duration, then requests in flight.)
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name did not stop in 30s; killing"; kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$(pidfile "$name")"
}

# Start a command detached from this shell, in its own session, logging to $state/<name>.log.
spawn() {
  local name=$1; shift
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$(pidfile "$name")"
}

# ---------------------------------------------------------------- ports
# Ports of every cluster on this machine, "<state dir> <port>" per line: a port stays
# claimed while its cluster exists, even while a component is stopped (fault tests stop and
# restart etcd or the apiserver on the same port), so another cluster never takes it.
port_registry="${TMPDIR:-/tmp}/clusterip-dev-cluster.ports"
port_claimed() {
  [ -f "$port_registry" ] || return 1
  local dir port
  while read -r dir port; do
    [ "$port" = "$1" ] && [ "$dir" != "$state" ] && [ -d "$dir" ] && return 0
  done < "$port_registry"
  return 1
}
port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q . && ! port_claimed "$1"; }
pick_port() {
  local p=$1
  while ! port_free "$p"; do p=$((p + 1)); done
  echo "$p"
}
# Keep only the lines of clusters that still exist and are not this one, then add ours.
# Called with the port lock held: any other `$port_registry.<pid>` is the temp file of a
# writer killed mid-write (it held the lock), and is removed.
claim_ports() {
  local tmp="$port_registry.$$" dir port
  rm -f "$port_registry".[0-9]*
  : > "$tmp"
  if [ -f "$port_registry" ]; then
    while read -r dir port; do
      [ "$dir" != "$state" ] && [ -d "$dir" ] && echo "$dir $port" >> "$tmp"
    done < "$port_registry"
  fi
  for port in "$@"; do echo "$state $port" >> "$tmp"; done
  mv "$tmp" "$port_registry"
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
    # the kube-apiserver's client certificate for calling admission webhooks (presented
    # through its AdmissionConfiguration, see write_admission_config); the clusterip webhook
    # accepts no other caller (--client-ca-file ca.crt --allowed-client-names $WEBHOOK_CLIENT_NAME).
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$WEBHOOK_CLIENT_NAME" \
      -keyout apiserver-webhook-client.key -out apiserver-webhook-client.csr 2>/dev/null
    openssl x509 -req -in apiserver-webhook-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile client.ext -out apiserver-webhook-client.crt 2>/dev/null
    # the clusterip webhook's serving certificate (the apiserver calls it on loopback).
    printf 'subjectAltName = IP:127.0.0.1, DNS:localhost\nextendedKeyUsage = serverAuth\n' > webhook.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=clusterip-webhook" -keyout webhook.key -out webhook.csr 2>/dev/null
    openssl x509 -req -in webhook.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile webhook.ext -out webhook.crt 2>/dev/null
    # kube-controller-manager's client certificate: the user its RBAC bootstrap roles name
    # (it then acts for each controller through that controller's ServiceAccount,
    # --use-service-account-credentials).
    openssl req -newkey rsa:2048 -nodes -subj "/CN=system:kube-controller-manager" \
      -keyout kcm.key -out kcm.csr 2>/dev/null
    openssl x509 -req -in kcm.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile client.ext -out kcm.crt 2>/dev/null
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
  local pki="$state/pki" file=${1:-kubeconfig} APISERVER_PORT=${2:-$APISERVER_PORT} cert=${3:-admin}
  cat > "$state/$file" <<EOF
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
    client-certificate: $pki/$cert.crt
    client-key: $pki/$cert.key
contexts:
- name: clusterip-dev
  context: {cluster: clusterip-dev, user: clusterip-dev-admin}
current-context: clusterip-dev
EOF
}

# How the kube-apiserver authenticates to admission webhooks (Kubernetes' "Authenticate
# apiservers"): an AdmissionConfiguration (--admission-control-config-file) gives both webhook
# plugins a kubeconfig whose users[].name is matched against the webhook's host:port; "*"
# matches every webhook, so the test suite's webhooks on 127.0.0.1:<any port> get it too.
write_admission_config() {
  local pki="$state/pki"
  cat > "$state/admission-kubeconfig" <<EOF
apiVersion: v1
kind: Config
users:
- name: "*"
  user:
    client-certificate: $pki/apiserver-webhook-client.crt
    client-key: $pki/apiserver-webhook-client.key
EOF
  cat > "$state/admission-config.yaml" <<EOF
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
- name: MutatingAdmissionWebhook
  configuration:
    apiVersion: apiserver.config.k8s.io/v1
    kind: WebhookAdmissionConfiguration
    kubeConfigFile: $state/admission-kubeconfig
- name: ValidatingAdmissionWebhook
  configuration:
    apiVersion: apiserver.config.k8s.io/v1
    kind: WebhookAdmissionConfiguration
    kubeConfigFile: $state/admission-kubeconfig
EOF
}

# ---------------------------------------------------------------- components
start_etcd() {
  if [ -n "${ETCD_2_PORT:-}" ]; then start_etcd_member etcd; return; fi
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

# CLUSTERIP_ETCD_MEMBERS=3: member etcd is named clusterip-dev (as when alone), etcd-N
# clusterip-dev-N. Ports: ETCD_PORT / ETCD_PEER_PORT / ETCD_METRICS_PORT for etcd,
# ETCD_N_PORT / ETCD_N_PEER_PORT / ETCD_N_METRICS_PORT for etcd-N (ports.env).
member_var() { local v; case "$1" in etcd) v=ETCD_$2 ;; *) v=ETCD_${1#etcd-}_$2 ;; esac; echo "${!v}"; }
member_name() { case "$1" in etcd) echo clusterip-dev ;; *) echo "clusterip-dev-${1#etcd-}" ;; esac; }
start_etcd_member() {
  local m=$1 peers="" c
  for c in etcd etcd-2 etcd-3; do peers+="${peers:+,}$(member_name "$c")=http://127.0.0.1:$(member_var "$c" PEER_PORT)"; done
  mkdir -p "$state/$m"
  # (--initial-cluster* count only with an empty data dir: a restarted member rejoins with its data.)
  spawn "$m" "$ETCD_BIN/etcd" \
    --name "$(member_name "$m")" --data-dir "$state/$m" \
    --listen-client-urls "http://127.0.0.1:$(member_var "$m" PORT)" --advertise-client-urls "http://127.0.0.1:$(member_var "$m" PORT)" \
    --listen-peer-urls "http://127.0.0.1:$(member_var "$m" PEER_PORT)" --initial-advertise-peer-urls "http://127.0.0.1:$(member_var "$m" PEER_PORT)" \
    --initial-cluster "$peers" --initial-cluster-state new --initial-cluster-token "clusterip-dev-$ETCD_PORT" \
    --listen-metrics-urls "http://127.0.0.1:$(member_var "$m" METRICS_PORT)" \
    --quota-backend-bytes 4294967296 --log-level warn
}
start_etcd-2() { start_etcd_member etcd-2; }
start_etcd-3() { start_etcd_member etcd-3; }
ready_etcd-2() { curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_2_METRICS_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }
ready_etcd-3() { curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_3_METRICS_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }
# Every member's client URL, comma-separated.
etcd_endpoints() {
  local e="http://127.0.0.1:$ETCD_PORT"
  [ -z "${ETCD_2_PORT:-}" ] || e+=",http://127.0.0.1:$ETCD_2_PORT,http://127.0.0.1:$ETCD_3_PORT"
  echo "$e"
}

start_kube-apiserver() { start_apiserver kube-apiserver "$APISERVER_PORT" "$(etcd_endpoints)"; }
start_kube-apiserver-2() { start_apiserver kube-apiserver-2 "$APISERVER_2_PORT" "${CLUSTERIP_APISERVER_2_ETCD_SERVERS:-$(etcd_endpoints)}"; }
start_apiserver() {
  local pki="$state/pki"
  spawn "$1" "$K8S_BIN/kube-apiserver" \
    --etcd-servers "$3" --etcd-prefix /registry \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$2" \
    --endpoint-reconciler-type none \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-cluster-ip-range "$SERVICE_CIDRS" \
    --authorization-mode RBAC --allow-privileged \
    --enable-admission-plugins MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
    --admission-control-config-file "$state/admission-config.yaml" \
    --disable-admission-plugins ServiceAccount \
    --profiling=false --v 1
}
ready_kube-apiserver() { ready_apiserver "$APISERVER_PORT"; }
ready_kube-apiserver-2() { ready_apiserver "$APISERVER_2_PORT"; }
ready_apiserver() {
  local pki="$state/pki"
  curl -fsS --max-time 2 --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:$1/readyz" 2>/dev/null | grep -q '^ok$'
}

# Every controller of a stock kube-controller-manager, each with its own ServiceAccount's
# credentials; no leader election (one instance). Its serving certificate is made in the
# state directory (--cert-dir), never in the default /var/run/kubernetes.
start_kube-controller-manager() {
  local pki="$state/pki"
  mkdir -p "$state/kcm-certs"
  spawn kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$state/kcm.kubeconfig" \
    --authentication-kubeconfig "$state/kcm.kubeconfig" --authorization-kubeconfig "$state/kcm.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --cert-dir "$state/kcm-certs" \
    --leader-elect=false --use-service-account-credentials \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --profiling=false --v 1
}
# (-k: its serving certificate is self-signed at start; loopback only, health text only.)
ready_kube-controller-manager() {
  curl -fsSk --max-time 2 \
    "https://127.0.0.1:$KCM_PORT/healthz" 2>/dev/null | grep -q '^ok$'
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

start_clusterip-controller() {
  local pki="$state/pki" profile=${CLUSTERIP_PROFILE:-debug} flags=()
  [ "$profile" = release ] && flags+=(--release)
  if [ -n "${CLUSTERIP_CONTROLLER_BIN:-}" ]; then
    echo "$CLUSTERIP_CONTROLLER_BIN" > "$state/clusterip-controller.bin"
  elif [ ! -f "$state/clusterip-controller.bin" ]; then
    log "building clusterip ($profile)"
    (cd "$repo" && cargo build --quiet "${flags[@]}" --bin clusterip)
  fi
  local bin; bin=$(controller_bin)
  spawn clusterip-controller "$bin" controller \
    --backend "${CLUSTERIP_BACKEND:-etcd}" --service-cidr "$CONTROLLER_CIDRS" \
    --etcd-endpoints "$(etcd_endpoints)" --kubeconfig "$state/kubeconfig" \
    --webhook-bind-address "127.0.0.1:$WEBHOOK_PORT" --metrics-bind-address "127.0.0.1:$CONTROLLER_METRICS_PORT" \
    --health-probe-bind-address "127.0.0.1:$CONTROLLER_HEALTH_PORT" \
    --tls-cert-file "$pki/webhook.crt" --tls-private-key-file "$pki/webhook.key" \
    --client-ca-file "$pki/ca.crt" --allowed-client-names "$WEBHOOK_CLIENT_NAME" \
    --shutdown-delay-duration 1s
  wait_ready clusterip-controller 60
  register_webhooks
}
ready_clusterip-controller() { curl -fsS --max-time 2 "http://127.0.0.1:$CONTROLLER_HEALTH_PORT/readyz" 2>/dev/null | grep -q '^ok$'; }

# Point the kube-apiserver at the controller's webhook (failurePolicy Fail: no Service
# gets an address we did not choose while the webhook is registered), and at its ServiceCIDR
# check (failurePolicy Ignore, as deploy/webhooks.yaml: a check, not a gate).
register_webhooks() {
  local ca; ca=$(base64 -w0 < "$state/pki/ca.crt")
  "$repo/scripts/kubectl.sh" --kubeconfig "$state/kubeconfig" apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: clusterip-dev}
webhooks:
- name: assign.clusterip.allocator
  clientConfig: {url: "https://127.0.0.1:$WEBHOOK_PORT/mutate", caBundle: "$ca"}
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [services], scope: Namespaced}]
  namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system]}]}
  failurePolicy: Fail
  sideEffects: NoneOnDryRun
  admissionReviewVersions: [v1]
  timeoutSeconds: 10
  reinvocationPolicy: Never
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: clusterip-dev}
webhooks:
- name: validate.clusterip.allocator
  clientConfig: {url: "https://127.0.0.1:$WEBHOOK_PORT/validate", caBundle: "$ca"}
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [services], scope: Namespaced}]
  namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system]}]}
  failurePolicy: Fail
  sideEffects: None
  admissionReviewVersions: [v1]
  timeoutSeconds: 10
- name: validate-servicecidr.clusterip.allocator
  clientConfig: {url: "https://127.0.0.1:$WEBHOOK_PORT/validate-servicecidr", caBundle: "$ca"}
  rules: [{apiGroups: [networking.k8s.io], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [servicecidrs], scope: Cluster}]
  failurePolicy: Ignore
  sideEffects: None
  admissionReviewVersions: [v1]
  timeoutSeconds: 5
EOF
}

unregister_webhooks() {
  [ -f "$state/kubeconfig" ] || return 0
  "$repo/scripts/kubectl.sh" --kubeconfig "$state/kubeconfig" delete --ignore-not-found --wait=false \
    mutatingwebhookconfiguration/clusterip-dev validatingwebhookconfiguration/clusterip-dev >/dev/null 2>&1 || true
}

wait_ready() {
  local name=$1 deadline=$((SECONDS + ${2:-120}))
  until "ready_$name"; do
    # (The pid may not show the binary yet — fork before exec — so check it exists.)
    kill -0 "$(cat "$(pidfile "$name")" 2>/dev/null || echo none)" 2>/dev/null || { tail -n 30 "$state/$name.log" >&2 || true; die "$name exited during start-up (log: $state/$name.log)"; }
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$state/$name.log" >&2 || true; die "$name not ready after ${2:-120}s (log: $state/$name.log)"; }
    sleep 0.5
  done
}

# shellcheck source=/dev/null
load_ports() { [ -f "$state/ports.env" ] && . "$state/ports.env"; }

all_running() {
  local c
  for c in "${COMPONENTS[@]}"; do live_pid "$c" >/dev/null || return 1; done
  load_ports || return 1
  for c in "${COMPONENTS[@]}"; do "ready_$c" || return 1; done
}

# ---------------------------------------------------------------- commands
# What `up` needs on the machine; a clear list instead of a failure half-way.
check_tools() {
  local missing=() t
  for t in go openssl ss curl flock setsid base64 realpath; do command -v "$t" >/dev/null || missing+=("$t"); done
  if [ "${CLUSTERIP_CONTROLLER:-1}" != 0 ]; then
    for t in cargo protoc; do command -v "$t" >/dev/null || missing+=("$t"); done
  fi
  [ ${#missing[@]} -eq 0 ] || die "missing tools: ${missing[*]} (Debian: apt-get install protobuf-compiler openssl iproute2 curl util-linux; Go ≥ 1.26 and Rust from their installers; or run .ci/run, which installs the packages)"
}

cmd_up() {
  # What killed runs left behind goes first (never anything whose owner is alive).
  cmd_reap >&2 || log "reap reported errors (above); going on"
  # scripts/test.sh and the benches install packages before anything runs; not in the middle
  # of a test (tests/support sets the marker too).
  [ "${CLUSTERIP_PACKAGES_ENSURED:-}" = 1 ] ||
    "$repo/scripts/lib/ensure-packages.sh" protobuf-compiler openssl iproute2 curl util-linux ca-certificates
  check_tools
  local owner=""
  if [ -n "${CLUSTERIP_OWNER_PID:-}" ]; then
    owner=$(owner_of "$CLUSTERIP_OWNER_PID") || die "CLUSTERIP_OWNER_PID=$CLUSTERIP_OWNER_PID: no such process"
  fi
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
  [ "$KCM" = 0 ] || extra+=(kube-controller-manager)
  "$builder" etcd kube-apiserver "${extra[@]}"
  mkdir -p "$state"
  [ -z "$owner" ] || echo "$owner" > "$state/owner"
  # Clusters started side by side (parallel tests) pick ports one at a time: the lock is held
  # from picking until every component has bound its ports and is ready.
  exec 9>"${TMPDIR:-/tmp}/clusterip-dev-cluster.ports.lock"
  flock 9
  holding_port_lock=1
  ETCD_PORT=$(pick_port "${CLUSTERIP_ETCD_PORT:-23790}")
  ETCD_PEER_PORT=$(pick_port $((ETCD_PORT + 10)))
  ETCD_METRICS_PORT=$(pick_port $((ETCD_PEER_PORT + 10)))
  APISERVER_PORT=$(pick_port "${CLUSTERIP_APISERVER_PORT:-26443}")
  WEBHOOK_PORT=$(pick_port "${CLUSTERIP_WEBHOOK_PORT:-29443}")
  CONTROLLER_METRICS_PORT=$(pick_port $((WEBHOOK_PORT + 10)))
  CONTROLLER_HEALTH_PORT=$(pick_port $((CONTROLLER_METRICS_PORT + 1)))
  local ports=("$ETCD_PORT" "$ETCD_PEER_PORT" "$ETCD_METRICS_PORT" "$APISERVER_PORT" "$WEBHOOK_PORT" "$CONTROLLER_METRICS_PORT" "$CONTROLLER_HEALTH_PORT")
  # Opt-in members and apiserver: each port is picked above the last one picked (ports
  # picked in this run are not claimed yet, so pick_port alone could give one out twice).
  local more="" next=$((ETCD_METRICS_PORT + 1)) n v
  if [ "$ETCD_MEMBERS" = 3 ]; then
    for n in 2 3; do
      for v in PORT PEER_PORT METRICS_PORT; do
        printf -v "ETCD_${n}_$v" '%s' "$(pick_port "$next")"
        next=$(( $(member_var "etcd-$n" "$v") + 1 ))
        ports+=("$(member_var "etcd-$n" "$v")")
        more+="ETCD_${n}_$v=$(member_var "etcd-$n" "$v")"$'\n'
      done
    done
  fi
  if [ "$APISERVERS" = 2 ]; then
    APISERVER_2_PORT=$(pick_port $((APISERVER_PORT + 1)))
    case " ${ports[*]} " in *" $APISERVER_2_PORT "*) die "no free port for kube-apiserver-2 after $APISERVER_PORT" ;; esac
    ports+=("$APISERVER_2_PORT")
    more+="APISERVER_2_PORT=$APISERVER_2_PORT"$'\n'
  fi
  if [ "$KCM" = 1 ]; then
    KCM_PORT=$(pick_port "${CLUSTERIP_KCM_PORT:-30257}")
    case " ${ports[*]} " in *" $KCM_PORT "*) die "no free port for kube-controller-manager at ${CLUSTERIP_KCM_PORT:-30257}" ;; esac
    ports+=("$KCM_PORT")
    more+="KCM_PORT=$KCM_PORT"$'\n'
  fi
  claim_ports "${ports[@]}"
  cat > "$state/ports.env" <<EOF
ETCD_PORT=$ETCD_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
ETCD_METRICS_PORT=$ETCD_METRICS_PORT
APISERVER_PORT=$APISERVER_PORT
WEBHOOK_PORT=$WEBHOOK_PORT
CONTROLLER_METRICS_PORT=$CONTROLLER_METRICS_PORT
CONTROLLER_HEALTH_PORT=$CONTROLLER_HEALTH_PORT
EOF
  printf '%s' "$more" >> "$state/ports.env"
  gen_certs
  write_kubeconfig
  [ "$KCM" = 0 ] || write_kubeconfig kcm.kubeconfig "$APISERVER_PORT" kcm
  write_admission_config
  # What tests and tools read: endpoints of the parts, one KEY=value per line.
  cat > "$state/env" <<EOF
KUBECONFIG=$state/kubeconfig
CLUSTERIP_ETCD_ENDPOINTS=$(etcd_endpoints)
CLUSTERIP_APISERVER=https://127.0.0.1:$APISERVER_PORT
CLUSTERIP_APISERVER_SERVICE_CIDRS=$SERVICE_CIDRS
CLUSTERIP_SERVICE_CIDRS=$CONTROLLER_CIDRS
CLUSTERIP_WEBHOOK_URL=https://127.0.0.1:$WEBHOOK_PORT
CLUSTERIP_METRICS_URL=http://127.0.0.1:$CONTROLLER_METRICS_PORT
CLUSTERIP_HEALTH_URL=http://127.0.0.1:$CONTROLLER_HEALTH_PORT
CLUSTERIP_WEBHOOK_CLIENT_CA=$state/pki/ca.crt
CLUSTERIP_WEBHOOK_CLIENT_NAME=$WEBHOOK_CLIENT_NAME
EOF
  if [ "$APISERVERS" = 2 ]; then
    write_kubeconfig kubeconfig-2 "$APISERVER_2_PORT"
    printf 'CLUSTERIP_APISERVER_2=https://127.0.0.1:%s\nKUBECONFIG_2=%s\n' "$APISERVER_2_PORT" "$state/kubeconfig-2" >> "$state/env"
  fi
  [ "$KCM" = 0 ] || echo "CLUSTERIP_KCM_URL=https://127.0.0.1:$KCM_PORT" >> "$state/env"
  # A failed start leaves nothing running (the log tail was already printed).
  trap 'rc=$?; if [ $rc -ne 0 ]; then log "start failed; stopping what was started"; cmd_down quiet; fi' EXIT
  [ -z "$owner" ] || [ "${CLUSTERIP_WATCHDOG:-1}" = 0 ] || start_watchdog
  local c
  for c in "${COMPONENTS[@]}"; do
    log "starting $c"
    "start_$c"
    # The members of a three-member etcd are ready only together (a quorum elects a leader).
    case "$c" in etcd|etcd-2) [ "$ETCD_MEMBERS" = 1 ] || continue ;; esac
    if [ "$c" = etcd-3 ]; then wait_ready etcd 300; wait_ready etcd-2 300; fi
    wait_ready "$c" 300
    log "$c ready"
  done
  exec 9>&-
  holding_port_lock=
  trap - EXIT
  echo "export KUBECONFIG=$state/kubeconfig"
}

# The watchdog of this cluster (an owned one), if it runs: pid on stdout.
watchdog_pid() {
  local f="$state/watchdog.pid" pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "__watchdog $state " || return 1
  echo "$pid"
}

# Polls the owner every second; once it is gone, stops the cluster. Ends with the cluster:
# `down` kills it, and it leaves when the state directory (its owner file) is gone.
cmd_watchdog() {
  local pid=$1 start=$2
  while [ -f "$state/owner" ] && owner_alive "$pid" "$start"; do sleep 1; done
  [ -f "$state/owner" ] || exit 0
  log "owner $pid is gone; stopping the cluster in $state"
  cmd_down quiet
}

start_watchdog() {
  local pid start
  read -r pid start < "$state/owner"
  setsid bash "$repo/scripts/dev-cluster.sh" __watchdog "$state" "$pid" "$start" \
    >"$state/watchdog.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$state/watchdog.pid"
}

cmd_down() {
  local i pid
  # The watchdog first, so that it does not stop the cluster at the same time (unless this is it).
  if pid=$(watchdog_pid) && [ "$pid" != $$ ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  rm -f "$state/watchdog.pid"
  # Everything a pid file names, whatever this invocation's CLUSTERIP_CONTROLLER says.
  for ((i = ${#ALL_COMPONENTS[@]} - 1; i >= 0; i--)); do stop_component "${ALL_COMPONENTS[$i]}"; done
  # (`up` cleaning up after a failed start already holds the lock.)
  if [ -n "${holding_port_lock:-}" ]; then claim_ports; else ( flock 8; claim_ports ) 8>"${TMPDIR:-/tmp}/clusterip-dev-cluster.ports.lock"; fi
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
  if [ -f "$state/owner" ]; then
    local opid ostart; read -r opid ostart < "$state/owner"
    if owner_alive "$opid" "$ostart"; then echo "owner: pid $opid (running)"; else echo "owner: pid $opid (gone: 'reap' removes this cluster)"; ok=1; fi
  fi
  [ $ok -eq 0 ] && echo "export KUBECONFIG=$state/kubeconfig"
  return $ok
}

component_arg() {
  local c
  for c in "${ALL_COMPONENTS[@]}"; do [ "$c" = "${1:-}" ] && return 0; done
  die "unknown component '${1:-}'; one of: ${COMPONENTS[*]}"
}

cmd_stop() {
  component_arg "$1"
  stop_component "$1"
}

cmd_start() {
  component_arg "$1"
  load_ports || die "no cluster in $state; run '$0 up' first"
  bin_dirs
  live_pid "$1" >/dev/null && { log "$1 already running"; return 0; }
  "start_$1"
  wait_ready "$1" 120
  log "$1 ready"
}

# ---------------------------------------------------------------- reap
# Clusters whose owner is gone: stopped (`down`), state dir and port registry lines removed.
reap_clusters() {
  local dirs=() d root dir port opid ostart c pid ports
  if [ -f "$port_registry" ]; then
    while read -r dir port; do dirs+=("$dir"); done < "$port_registry"
  fi
  # (Other data dirs with an owner file are reap_dirs' business.)
  while IFS= read -r root; do
    for d in "$root"/clusterip-*/; do
      d=${d%/}
      if [ -f "$d/ports.env" ] || [ -f "$d/etcd.pid" ] || [ -f "$d/watchdog.pid" ]; then dirs+=("$d"); fi
    done
  done < <(tmp_roots)
  for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do
    [ -f "$d/owner" ] || continue
    owner_file_alive "$d/owner" && continue
    read -r opid ostart < "$d/owner" || true
    (
      state=$d
      for c in "${ALL_COMPONENTS[@]}"; do
        pid=$(live_pid "$c") && echo "reap: cluster $d: stopping $c (pid $pid)"
      done
      ports=$(awk -v d="$d" '$1 == d { printf " %s", $2 }' "$port_registry" 2>/dev/null || true)
      cmd_down quiet 2>/dev/null
      [ -z "$ports" ] || echo "reap: cluster $d: released ports$ports"
      echo "reap: removed cluster $d (owner $opid gone)"
    )
  done
  # Registry lines of clusters whose directory is gone (removed by hand, say); skipped while
  # a cluster is starting (it holds the lock; any later up/down drops such lines too).
  (
    flock -n 8 || exit 0
    [ -f "$port_registry" ] || exit 0
    while read -r dir port; do [ -d "$dir" ] || echo "reap: released port $port of $dir (directory gone)"; done < "$port_registry"
    claim_ports_keep_existing
  ) 8>"${TMPDIR:-/tmp}/clusterip-dev-cluster.ports.lock"
}

# Rewrite the registry without lines of clusters whose directory is gone.
claim_ports_keep_existing() {
  local tmp="$port_registry.$$" dir port
  : > "$tmp"
  while read -r dir port; do [ -d "$dir" ] && echo "$dir $port" >> "$tmp"; done < "$port_registry"
  mv "$tmp" "$port_registry"
}

# Everything of runs whose owner is gone, in an order that needs one pass: processes of dead
# runs first (their clusters' owners, watchdogs, orphans die with them), then memory caps,
# clusters, network namespaces, data directories. One reap at a time on the machine.
cmd_reap() {
  local rc=0 out more
  exec 7>"${TMPDIR:-/tmp}/clusterip-reap.lock"
  flock 7
  # Runs and memory caps contain each other's owners (a bench's run-capped.sh outside its run,
  # a run's run-capped.sh inside it): another pass while the last one removed something.
  for _ in 1 2 3 4; do
    more=
    out=$(reap_runs) || rc=1
    [ -z "$out" ] || { echo "$out"; more=1; }
    out=$(reap_caps) || rc=1
    [ -z "$out" ] || { echo "$out"; more=1; }
    [ -n "$more" ] || break
  done
  reap_clusters || rc=1
  reap_netns || rc=1
  reap_dirs || rc=1
  exec 7>&-
  return $rc
}

case "${1:-}" in
  up) cmd_up ;;
  reap) cmd_reap ;;
  __watchdog) state=$2; cmd_watchdog "$3" "$4" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  stop) cmd_stop "${2:-}" ;;
  start) cmd_start "${2:-}" ;;
  *) echo "usage: $0 up|down|status|reap|stop COMPONENT|start COMPONENT" >&2; exit 2 ;;
esac
