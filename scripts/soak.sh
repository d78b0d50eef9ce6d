#!/usr/bin/env bash
# Soak: Service create/update/delete churn at a steady rate through the webhook, for each
# backend in turn (etcd, then ipaddress), with the node agent programming the VIPs into a
# network namespace; invariants checked all along; RSS of every component sampled.
#
#   scripts/soak.sh [MINUTES]          MINUTES of churn per backend (default 10)
#   SOAK_REPLICAS=3 scripts/soak.sh [MINUTES]
#                                      three ipaddress-backend replicas instead, behind one
#                                      webhook, under churn (20 creates/s, each Service lives
#                                      7.5 s) while their faults repeat in rounds: a held block
#                                      Lease deleted, a replica frozen 1.5 × D, a replica's path
#                                      to the apiserver black-holed 120 s, one delayed 5 s —
#                                      take-overs and hand-overs throughout. It is the test
#                                      controller_e2e::faults::ipaddress_backend_three_replicas_under_faults
#                                      sized to MINUTES (CLUSTERIP_FAULTS_CREATES = 1200 per
#                                      minute); its RESULT line counts refusals, duplicates,
#                                      take-overs and hand-overs (docs/reliability.md).
#
# Per backend: a private control plane (scripts/dev-cluster.sh up: etcd, kube-apiserver,
# the clusterip controller with its webhooks registered, backend CLUSTERIP_BACKEND), the
# agent (`clusterip-agent --netns`) programming a node namespace cip<pid>xsn, a client
# namespace cip<pid>xsc routed through it, and a backend namespace cip<pid>xsb with a TCP
# responder. Four probe Services (selectorless, an EndpointSlice to the responder) stay all
# along; churned Services get no endpoints. The churn: SOAK_RATE operations per second
# (default 10) over a working set of up to SOAK_SERVICES Services (default 200): creates
# (every 5th PreferDualStack), deletes, label updates, ClusterIP → ExternalName and back.
#
# Every SOAK_CHECK_S seconds (default 30), and once after the churn:
#   - unique addresses: no address on two Services (one list of all Services);
#   - every Service's address recorded: an IPAddress named by it whose parentRef is that
#     Service (a miss is read again, Service and IPAddress, before it counts), and
#     `clusterip repair` (dry run) reports no missing-record, wrong-reference or duplicate;
#   - the probe VIPs answer from the client namespace (connect + the responder's reply);
#   - RSS (VmRSS) of etcd, kube-apiserver, the controller and the agent, every 10 s.
# After the churn: `clusterip repair --fix` (etcd: --release-leaks-now), then a dry run
# must find the records consistent (exit 0) within 120 s: no leak after repair.
#
# Prints RESULT lines (throughput, errors, violations, memory start/end/max per component:
# VmRSS, and RssAnon — etcd's VmRSS includes its mapped database file) and
# exits 1 on any violation, failed operation or component death. Must run as root.
#
# Env: SOAK_BACKENDS (default "etcd ipaddress"), SOAK_RATE, SOAK_SERVICES, SOAK_CHECK_S,
# SOAK_MEM_MIB (memory cap of the whole run, default 6144; 0 = none), CLUSTERIP_PROFILE
# (debug|release, default debug). Logs: target/soak/<date>-<pid>/.
#
# Nothing outlives it (scripts/lib/run.sh): the run is in a pids cgroup of its own (whatever
# is left is killed at the end; a SIGKILLed run is reaped by the next run or
# `scripts/dev-cluster.sh reap`), its clusters are owned by it (watchdog), its namespaces are
# cip<pid>x…, and the whole run is under a memory cap (scripts/lib/run-capped.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# shellcheck source=lib/run.sh
. scripts/lib/run.sh

minutes=${1:-10}
[[ $minutes =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [MINUTES]  (a whole number ≥ 1)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "soak: must run as root (network namespaces)" >&2; exit 2; }
run_capped "${SOAK_MEM_MIB:-6144}" "$@"
run_begin soak

if [ "${SOAK_REPLICAS:-1}" = 3 ]; then
  logs=$root/target/soak/$(date -u +%Y%m%dT%H%M%S)-$$-replicas
  mkdir -p "$logs"
  echo "soak: three replicas under faults for about $minutes min (log: $logs/faults.log)" >&2
  rc=0
  CLUSTERIP_FAULTS_CREATES=$((minutes * 1200)) CLUSTERIP_FAULTS_BLACKHOLE_S=120 \
    scripts/test.sh --test controller_e2e -- faults:: --nocapture > "$logs/faults.log" 2>&1 || rc=$?
  grep '^RESULT' "$logs/faults.log" || true
  [ "$rc" = 0 ] || { echo "soak: FAILED (exit $rc); see $logs/faults.log" >&2; exit 1; }
  exit 0
elif [ "${SOAK_REPLICAS:-1}" != 1 ]; then
  echo "soak: SOAK_REPLICAS is 1 (the default) or 3" >&2
  exit 2
fi

backends=${SOAK_BACKENDS:-etcd ipaddress}
rate=${SOAK_RATE:-10}
target=${SOAK_SERVICES:-200}
check_every=${SOAK_CHECK_S:-30}
profile=${CLUSTERIP_PROFILE:-debug}
logs=$root/target/soak/$(date -u +%Y%m%dT%H%M%S)-$$
mkdir -p "$logs"
ns_node=cip$$xsn ns_client=cip$$xsc ns_backend=cip$$xsb
cluster=""
failed=0

say() { echo "soak: $*" >&2; }
violation() { say "VIOLATION: $*"; echo "$*" >> "$logs/violations"; failed=1; }

teardown_phase() {
  if [ -n "${agent_pid:-}" ]; then kill -TERM "$agent_pid" 2>/dev/null || true; wait "$agent_pid" 2>/dev/null || true; fi
  agent_pid=""
  for n in "$ns_client" "$ns_backend" "$ns_node"; do
    if [ -e "/run/netns/$n" ]; then
      for p in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
      ip netns delete "$n" 2>/dev/null || true
    fi
  done
  if [ -n "$cluster" ]; then
    CLUSTERIP_CLUSTER_DIR=$cluster scripts/dev-cluster.sh down >/dev/null 2>&1 || true
    rm -rf "$cluster"
    cluster=""
  fi
}
cleanup() {
  local rc=$?
  trap - EXIT
  teardown_phase
  run_end
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

say "building clusterip and clusterip-agent ($profile)"
build=(); [ "$profile" = release ] && build=(--release)
cargo build -j2 --quiet "${build[@]}" --workspace --bins &
wait $!
bin=$CARGO_TARGET_DIR/$profile

# ------------------------------------------------------------------ API calls (curl)
api() { # METHOD PATH [BODY [CONTENT-TYPE]]: sets $code (HTTP status, 000 = no answer) and $body
  code=$(curl -sS --max-time 30 --cacert "$cluster/pki/ca.crt" -H "Authorization: Bearer $token" \
    -X "$1" ${3:+-H "Content-Type: ${4:-application/json}"} ${3:+--data-binary "$3"} \
    -o "$logs/body" -w '%{http_code}' "$apiserver$2" 2>>"$logs/curl.err") || code=000
  body=$(cat "$logs/body" 2>/dev/null || true)
}
svc_path=/api/v1/namespaces/soak/services

# ------------------------------------------------------------------ the node, client, backend
setup_netns() {
  ip netns add "$ns_node"; ip netns add "$ns_client"; ip netns add "$ns_backend"
  for n in "$ns_node" "$ns_client" "$ns_backend"; do ip -n "$n" link set lo up; done
  ip netns exec "$ns_node" sysctl -qw net.ipv4.ip_forward=1
  ip -n "$ns_node" link add c0 type veth peer name eth0 netns "$ns_client"
  ip -n "$ns_node" addr add 198.18.70.1/24 dev c0; ip -n "$ns_node" link set c0 up
  ip -n "$ns_client" addr add 198.18.70.2/24 dev eth0; ip -n "$ns_client" link set eth0 up
  ip -n "$ns_client" route add default via 198.18.70.1
  ip -n "$ns_node" link add b0 type veth peer name eth0 netns "$ns_backend"
  ip -n "$ns_node" addr add 198.18.71.1/24 dev b0; ip -n "$ns_node" link set b0 up
  ip -n "$ns_backend" addr add 198.18.71.2/24 dev eth0; ip -n "$ns_backend" link set eth0 up
  ip -n "$ns_backend" route add default via 198.18.71.1
  # VIPs are routed towards the backends, as on a node (the agent's rules DNAT them).
  ip -n "$ns_node" route add 198.19.0.0/16 dev b0
  ip netns exec "$ns_backend" python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(256)
while True:
    c, _ = s.accept()
    try: c.sendall(b"soak\n")
    except OSError: pass
    c.close()' > "$logs/responder.log" 2>&1 &
  disown $!   # (ended with the namespace: no job notice)
}

probe() { # VIP -> 0 when the responder answers through it
  [ "$(ip netns exec "$ns_client" timeout 5 bash -c "exec 3<>/dev/tcp/$1/80 && head -c 4 <&3" 2>/dev/null)" = soak ]
}

# VmRSS and, of it, RssAnon (KiB): etcd's RSS also counts the pages of its database file
# it has mapped (RssFile), which grow with the history it keeps until compaction.
rss_kib() { awk '/^VmRSS:/ {r = $2} /^RssAnon:/ {a = $2} END {print (r ? r : 0), (a ? a : 0)}' "/proc/$1/status" 2>/dev/null || echo 0 0; }
sample_rss() { # time, then VmRSS and RssAnon KiB per component
  local line=$SECONDS c
  for c in etcd kube-apiserver clusterip-controller agent; do line+=" $(rss_kib "${pids[$c]}")"; done
  echo "$line" >> "$logs/$backend.rss"
}

# ------------------------------------------------------------------ invariants
check() { # $1: "churn" (leaks tolerated) or "final"
  local services dup missing r rc
  api GET /api/v1/services; services=$body; [ "$code" = 200 ] || { violation "listing Services: HTTP $code"; return; }
  api GET /apis/networking.k8s.io/v1/ipaddresses; cp "$logs/body" "$logs/ipaddresses.json"; [ "$code" = 200 ] || { violation "listing IPAddresses: HTTP $code"; return; }
  dup=$(jq -r '[.items[] | .spec.clusterIPs[]? | select(. != "None")] | group_by(.) | map(select(length > 1) | .[0]) | .[]' <<<"$services")
  [ -z "$dup" ] || violation "addresses on two Services: $dup"
  # Service addresses without an IPAddress naming that Service (read again before counting).
  missing=$(jq -r --slurpfile ips "$logs/ipaddresses.json" '
    ($ips[0].items | map({key: .metadata.name, value: .spec.parentRef}) | from_entries) as $by
    | .items[] | . as $s | .spec.clusterIPs[]? | select(. != "None")
    | select(($by[.] // {}) as $p | ($p.resource != "services" or $p.namespace != $s.metadata.namespace or $p.name != $s.metadata.name))
    | "\($s.metadata.namespace)/\($s.metadata.name) \(.)"' <<<"$services")
  while read -r svc ip; do
    [ -n "$svc" ] || continue
    api GET "/api/v1/namespaces/${svc%/*}/services/${svc#*/}"
    [ "$code" = 200 ] && jq -e --arg ip "$ip" '.spec.clusterIPs // [] | index($ip)' <<<"$body" >/dev/null || continue
    api GET "/apis/networking.k8s.io/v1/ipaddresses/$ip"
    if [ "$code" != 200 ] || ! jq -e --arg ns "${svc%/*}" --arg n "${svc#*/}" '.spec.parentRef | .resource == "services" and .namespace == $ns and .name == $n' <<<"$body" >/dev/null; then
      violation "$svc holds $ip, which no IPAddress records for it"
    fi
  done <<<"$missing"
  rc=0
  "$bin/clusterip" repair "${repair_flags[@]}" -o json > "$logs/repair.json" 2>> "$logs/repair.err" || rc=$?
  if [ "$rc" = 2 ]; then violation "clusterip repair failed: $(tail -n 1 "$logs/repair.err")"; return; fi
  r=$(jq -r '.findings[] | select(.kind != "leak") | "\(.kind) \(.address) \(.owner)"' "$logs/repair.json")
  [ -z "$r" ] || violation "repair found: $(tr '\n' ';' <<<"$r")"
  for vip in "${probe_vips[@]}"; do probe "$vip" || violation "probe VIP $vip does not answer from the client namespace"; done
  checks=$((checks + 1))
}

# ------------------------------------------------------------------ churn
declare -a names=()
declare -A kind=()
seq_no=0
op() { # one create / delete / update; counts it
  local n i r extra what
  if [ ${#names[@]} -lt $((target / 2)) ]; then r=0; else r=$((RANDOM % 100)); fi
  if [ ${#names[@]} -ge "$target" ] && [ "$r" -lt 35 ]; then r=40; fi
  if [ "$r" -lt 35 ]; then
    seq_no=$((seq_no + 1)); n=s$seq_no; what=create
    if [ $((seq_no % 5)) = 0 ]; then extra=',"ipFamilyPolicy":"PreferDualStack"'; else extra=""; fi
    api POST "$svc_path" "{\"metadata\":{\"name\":\"$n\"},\"spec\":{\"ports\":[{\"port\":80}]$extra}}"
    [ "$code" = 201 ] && { names+=("$n"); kind[$n]=c; }
  else
    i=$((RANDOM % ${#names[@]})); n=${names[$i]}
    if [ "$r" -lt 65 ]; then
      what=delete
      api DELETE "$svc_path/$n"
      [ "$code" = 200 ] && { names[$i]=${names[-1]}; unset 'names[-1]'; unset "kind[$n]"; }
    elif [ "$r" -lt 82 ]; then
      what=update-label
      api PATCH "$svc_path/$n" "{\"metadata\":{\"labels\":{\"soak\":\"$seq_no\"}}}" application/merge-patch+json
    elif [ "${kind[$n]}" = c ]; then
      what=to-externalname
      api PATCH "$svc_path/$n" '{"spec":{"type":"ExternalName","externalName":"soak.example"}}' application/merge-patch+json
      [ "$code" = 200 ] && kind[$n]=e
    else
      what=to-clusterip
      api PATCH "$svc_path/$n" '{"spec":{"type":"ClusterIP","externalName":null}}' application/merge-patch+json
      [ "$code" = 200 ] && kind[$n]=c
    fi
  fi
  ops=$((ops + 1))
  case $code in 200|201) ;; *) errors=$((errors + 1)); echo "$SECONDS $what $n HTTP $code" >> "$logs/$backend.errors" ;; esac
}

# ------------------------------------------------------------------ one backend
phase() {
  backend=$1
  say "$backend: starting a control plane"
  cluster=$(owned_tmpdir "soak-$backend")
  CLUSTERIP_CLUSTER_DIR=$cluster CLUSTERIP_BACKEND=$backend CLUSTERIP_PROFILE=$profile scripts/dev-cluster.sh up >/dev/null
  # shellcheck source=/dev/null
  . "$cluster/ports.env"
  apiserver=https://127.0.0.1:$APISERVER_PORT
  token=$(cat "$cluster/pki/admin.token")
  declare -gA pids=([etcd]=$(cat "$cluster/etcd.pid") [kube-apiserver]=$(cat "$cluster/kube-apiserver.pid") [clusterip-controller]=$(cat "$cluster/clusterip-controller.pid"))
  cidrs=198.19.0.0/17,fd00:10:96::/113
  repair_flags=(--backend "$backend" --service-cidr "$cidrs" --kubeconfig "$cluster/kubeconfig")
  [ "$backend" = etcd ] && repair_flags+=(--etcd-endpoints "http://127.0.0.1:$ETCD_PORT")
  api POST /api/v1/namespaces '{"metadata":{"name":"soak"}}'
  [ "$code" = 201 ] || { violation "$backend: creating the namespace: HTTP $code"; return; }

  setup_netns
  "$bin/clusterip-agent" --netns "$ns_node" --node-name soak-node --kubeconfig "$cluster/kubeconfig" \
    --healthz-bind-address "" --metrics-bind-address "" --min-sync-period 100ms > "$logs/$backend.agent.log" 2>&1 &
  agent_pid=$!
  pids[agent]=$agent_pid

  probe_vips=()
  local i vip deadline
  for i in 0 1 2 3; do
    api POST "$svc_path" "{\"metadata\":{\"name\":\"probe-$i\"},\"spec\":{\"ports\":[{\"port\":80,\"targetPort\":8080}]}}"
    vip=$(jq -r '.spec.clusterIP' <<<"$body")
    [ "$code" = 201 ] || { violation "$backend: creating probe-$i: HTTP $code"; return; }
    api POST /apis/discovery.k8s.io/v1/namespaces/soak/endpointslices "{\"metadata\":{\"name\":\"probe-$i\",\"labels\":{\"kubernetes.io/service-name\":\"probe-$i\"}},\"addressType\":\"IPv4\",\"ports\":[{\"port\":8080,\"protocol\":\"TCP\"}],\"endpoints\":[{\"addresses\":[\"198.18.71.2\"],\"conditions\":{\"ready\":true}}]}"
    [ "$code" = 201 ] || { violation "$backend: creating probe-$i's EndpointSlice: HTTP $code"; return; }
    probe_vips+=("$vip")
  done
  deadline=$((SECONDS + 120))
  for vip in "${probe_vips[@]}"; do
    until probe "$vip"; do
      [ $SECONDS -lt $deadline ] || { violation "$backend: probe VIP $vip not answering 120 s after its creation"; return; }
      sleep 0.5
    done
  done
  say "$backend: probes answer (${probe_vips[*]}); churning for $minutes min at $rate ops/s"

  names=(); kind=(); ops=0; errors=0; checks=0
  : > "$logs/$backend.rss"
  sample_rss
  local start=$SECONDS end=$((SECONDS + minutes * 60)) next_check=$((SECONDS + check_every)) next_rss=$((SECONDS + 10))
  local t0 due now c
  t0=$(date +%s%N)
  while [ $SECONDS -lt $end ]; do
    op
    for c in etcd kube-apiserver clusterip-controller agent; do
      kill -0 "${pids[$c]}" 2>/dev/null || { violation "$backend: $c (pid ${pids[$c]}) died"; return; }
    done
    [ $SECONDS -lt $next_rss ] || { sample_rss; next_rss=$((SECONDS + 10)); }
    [ $SECONDS -lt $next_check ] || { check churn; next_check=$((SECONDS + check_every)); }
    # Steady rate: operation k is due at t0 + k/rate; behind schedule, go on at once.
    due=$((t0 + ops * 1000000000 / rate)); now=$(date +%s%N)
    [ "$now" -ge "$due" ] || sleep "$(awk -v n=$((due - now)) 'BEGIN {printf "%.3f", n / 1e9}')"
  done
  local elapsed=$((SECONDS - start))
  sample_rss
  say "$backend: churn done ($ops operations, $errors failed, ${#names[@]} Services left); final check and repair"
  check final
  local rc=0 consistent=0
  "$bin/clusterip" repair "${repair_flags[@]}" --fix $([ "$backend" = etcd ] && echo --release-leaks-now) --grace-period 0s > "$logs/$backend.repair-fix.txt" 2>&1 || rc=$?
  [ "$rc" != 2 ] || violation "$backend: clusterip repair --fix failed: $(tail -n 1 "$logs/$backend.repair-fix.txt")"
  deadline=$((SECONDS + 120))
  while [ $SECONDS -lt $deadline ]; do
    rc=0; "$bin/clusterip" repair "${repair_flags[@]}" > "$logs/$backend.repair-after.txt" 2>&1 || rc=$?
    [ "$rc" = 0 ] && { consistent=1; break; }
    sleep 2
  done
  [ "$consistent" = 1 ] || violation "$backend: records not consistent 120 s after repair --fix: $(tail -n 3 "$logs/$backend.repair-after.txt" | tr '\n' ' ')"
  local services panics
  api GET "$svc_path"; services=$(jq '.items | length' <<<"$body")
  panics=$(cat "$cluster/clusterip-controller.log" "$logs/$backend.agent.log" | grep -c 'panicked' || true)
  [ "$panics" = 0 ] || violation "$backend: $panics panic(s) in the controller's or the agent's log"
  [ "$errors" = 0 ] || violation "$backend: $errors operations failed (see $logs/$backend.errors)"
  echo "RESULT soak backend=$backend minutes=$minutes operations=$ops failed=$errors ops_per_s=$(awk -v o="$ops" -v s="$elapsed" 'BEGIN {printf "%.2f", o / s}') checks=$checks services_at_end=$services repair_consistent=$consistent violations=$(cat "$logs/violations" 2>/dev/null | wc -l)"
  local first last
  first=$(head -n 1 "$logs/$backend.rss"); last=$(tail -n 1 "$logs/$backend.rss")
  i=2
  local mib='{printf "%.1f", $f / 1024}' max='BEGIN {m = 0} $f > m {m = $f} END {printf "%.1f", m / 1024}'
  for c in etcd kube-apiserver clusterip-controller agent; do
    echo "RESULT soak_rss backend=$backend component=$c start_mib=$(awk -v f=$i "$mib" <<<"$first") end_mib=$(awk -v f=$i "$mib" <<<"$last") max_mib=$(awk -v f=$i "$max" "$logs/$backend.rss") anon_start_mib=$(awk -v f=$((i + 1)) "$mib" <<<"$first") anon_end_mib=$(awk -v f=$((i + 1)) "$mib" <<<"$last")"
    i=$((i + 2))
  done
  cp "$cluster/clusterip-controller.log" "$logs/$backend.controller.log" 2>/dev/null || true
}

for b in $backends; do
  phase "$b"
  teardown_phase
done
[ -s "$logs/violations" ] && failed=1
if [ "$failed" = 0 ]; then say "passed; logs in $logs"; else say "FAILED; violations in $logs/violations"; fi
exit "$failed"
