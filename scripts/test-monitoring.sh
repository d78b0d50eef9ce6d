#!/usr/bin/env bash
# deploy/monitoring/ against a real Prometheus v3 (built from Go modules:
# scripts/lib/build-go-binaries.sh prometheus promtool prometheus-operator-crds):
#
#   scripts/test-monitoring.sh rules   offline: `promtool check rules` and `promtool test rules`
#                                      (deploy/monitoring/tests/*.yaml) on the PrometheusRule,
#                                      every alert expected to fire by a test, the dashboard's
#                                      JSON, the component rendered by kustomize
#   scripts/test-monitoring.sh         the same, then on a node of its own
#                                      (scripts/node-cluster.sh, images from
#                                      scripts/build-images.sh): deploy/ installed, the
#                                      operator's CRDs applied and the component checked with a
#                                      server-side dry-run and applied; Prometheus run in the
#                                      node's network namespace, scraping what the PodMonitors
#                                      select (kubernetes_sd with the node's admin kubeconfig)
#                                      and evaluating the PrometheusRule; asserts
#                                        up == 1 for both jobs (every controller replica, the agent),
#                                        every metric family either component exposes has a series,
#                                        every dashboard query returns a series,
#                                        every rule evaluates without error,
#                                        every query of the kubernetes-mixin's kube-proxy
#                                        dashboard (deploy/monitoring/tests/
#                                        kube-proxy-mixin-queries.txt) returns a series
#                                        (or evaluates, where the file says so), after an
#                                        endpoint change and an Event the agent posted.
#
# Owns what it starts: the node (CLUSTERIP_NODE_DIR, default a temporary directory; it must
# not hold a node already) and Prometheus; both are removed at exit, also on failure or
# interrupt (CLUSTERIP_NODE_KEEP=1 leaves the node up). CLUSTERIP_NODE_BUILD_IMAGES=0 uses
# target/images as it is. Fails at once, saying why, when a part cannot work. Bounded: every
# wait has a deadline.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
# shellcheck source=lib/run.sh
. "$repo/scripts/lib/run.sh"

node=$repo/scripts/node-cluster.sh
mon=$repo/deploy/monitoring
helper=$repo/scripts/lib/monitoring.py
mode=${1:-all}
started=$SECONDS

log() { echo "test-monitoring: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
k() { "$node" kubectl "$@"; }
case "$mode" in rules | all) ;; *) die "usage: $0 [rules]" ;; esac
python3 -c 'import yaml' 2>/dev/null || die "needs python3 with PyYAML (Debian: python3-yaml)"
command -v jq >/dev/null || die "needs jq"

work=$(mktemp -d "${TMPDIR:-/tmp}/clusterip-monitoring.XXXXXX")
prom_pid=
holder_pid=
finish() {
  local rc=$?
  if [ -n "$holder_pid" ]; then kill "$holder_pid" 2>/dev/null; fi
  if [ -n "$prom_pid" ]; then
    kill "$prom_pid" 2>/dev/null
    local d=$((SECONDS + 15))
    while kill -0 "$prom_pid" 2>/dev/null && [ $SECONDS -lt $d ]; do sleep 0.2; done
    if kill -0 "$prom_pid" 2>/dev/null; then kill -9 "$prom_pid"; fi
    wait 2>/dev/null
  fi
  if [ "$mode" = all ] && [ -n "${owns_node:-}" ]; then
    if [ "${CLUSTERIP_NODE_KEEP:-}" = 1 ]; then
      log "node left up in $CLUSTERIP_NODE_DIR (CLUSTERIP_NODE_DIR=$CLUSTERIP_NODE_DIR scripts/node-cluster.sh down)"
    else
      "$node" down >&2 || true
    fi
  fi
  rm -rf "$work"
  run_end
  log "$((SECONDS - started))s"
  exit $rc
}
run_begin test-monitoring
trap finish EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- offline
"$repo/scripts/lib/build-go-binaries.sh" prometheus promtool prometheus-operator-crds || die "building Prometheus/promtool or fetching the operator's CRDs"
eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
promtool=$PROMETHEUS_BIN/promtool
python3 "$helper" rules "$mon/prometheusrule.yaml" "$work/clusterip-rules.yaml" || die "reading the PrometheusRule"
"$promtool" check rules "$work/clusterip-rules.yaml" >&2 || die "promtool check rules"
# (The tests name the rule file beside them.)
mkdir -p "$work/tests" && cp "$mon"/tests/*.yaml "$work/clusterip-rules.yaml" "$work/tests/"
tests=("$mon"/tests/*.yaml)
(cd "$work/tests" && "$promtool" test rules "${tests[@]##*/}") >&2 || die "promtool test rules (deploy/monitoring/tests)"
python3 "$helper" tested-alerts "$mon/prometheusrule.yaml" "$mon"/tests/*.yaml >&2 || die "every alert needs a unit test"
jq -e '.panels | length > 0' "$mon/dashboard.json" >/dev/null || die "deploy/monitoring/dashboard.json: no panels"
eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
"$repo/scripts/lib/build-go-binaries.sh" kubectl || die "building kubectl"
mkdir -p "$work/render"
cat > "$work/render/kustomization.yaml" <<EOF
resources: [$(realpath --relative-to="$work/render" "$repo/deploy")]
components: [$(realpath --relative-to="$work/render" "$mon")]
EOF
"$K8S_BIN/kubectl" kustomize "$work/render" > "$work/rendered.yaml" || die "kubectl kustomize deploy/ + deploy/monitoring"
for kind in PodMonitor PrometheusRule; do
  grep -q "^kind: $kind$" "$work/rendered.yaml" || die "the rendered component has no $kind"
done
# shellcheck disable=SC2016 # (a literal $(NODE_IP): the kubelet expands it)
grep -q -- '--metrics-bind-address=$(NODE_IP):10249' "$work/rendered.yaml" || die "the agent's metrics are not on the node's address"
log "rules, unit tests, dashboard JSON, kustomize render: ok"
[ "$mode" = rules ] && exit 0

# ---------------------------------------------------------------- the node
"$node" reap >&2 || true
export CLUSTERIP_NODE_DIR=${CLUSTERIP_NODE_DIR:-${TMPDIR:-/tmp}/cipnode-monitoring-$$}
[ -e "$CLUSTERIP_NODE_DIR/unshare.pid" ] && die "$CLUSTERIP_NODE_DIR already holds a node; this script brings up its own (another CLUSTERIP_NODE_DIR)"
state=$CLUSTERIP_NODE_DIR
owns_node=1
if [ "${CLUSTERIP_NODE_BUILD_IMAGES:-1}" != 0 ]; then
  scripts/build-images.sh clusterip clusterip-agent pause >&2 || die "scripts/build-images.sh"
fi
CLUSTERIP_NODE_BUILD_IMAGES=0 "$node" up >&2 || die "scripts/node-cluster.sh up"
"$node" deploy >&2 || die "scripts/node-cluster.sh deploy"

# The operator's CRDs (what the component needs), then the component on top of the node's
# overlay: a server-side dry-run, then for real (the agent's metrics move to the node's
# address). The webhook registrations are left out as `deploy` does the first time (their
# caBundle is already patched in).
for crd in servicemonitors podmonitors prometheusrules; do
  k apply --server-side -f "$PROMETHEUS_OPERATOR_CRDS/monitoring.coreos.com_$crd.yaml" >&2 || die "applying the CRD $crd"
done
k wait --for condition=Established --timeout=60s crd/podmonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com >&2 || die "the operator's CRDs not Established"
overlay=$state/monitoring
mkdir -p "$overlay"
cat > "$overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../deploy]
components: [$(realpath --relative-to="$overlay" "$mon")]
EOF
k apply --dry-run=server -k "$overlay" -l 'app.kubernetes.io/component!=admission-registration' > "$work/dry-run.txt" ||
  die "server-side dry-run of deploy/ + deploy/monitoring"
for o in podmonitor.monitoring.coreos.com/clusterip-controller podmonitor.monitoring.coreos.com/clusterip-agent \
  prometheusrule.monitoring.coreos.com/clusterip configmap/clusterip-dashboard daemonset.apps/clusterip-agent; do
  grep -q "^$o .*(server dry run)" "$work/dry-run.txt" || die "dry-run: no '$o' in: $(cat "$work/dry-run.txt")"
done
log "server-side dry-run: $(grep -c 'server dry run' "$work/dry-run.txt") objects accepted, the component's among them"
k apply -k "$overlay" -l 'app.kubernetes.io/component!=admission-registration' >&2 || die "applying deploy/ + deploy/monitoring"
k -n kube-system rollout status daemonset/clusterip-agent --timeout=180s >&2 || die "the agent did not roll out with its metrics on the node's address"

# Admissions and allocations to measure: Services created (one asking for an address), one
# deleted.
k create namespace monitoring-test >/dev/null 2>&1
for i in 1 2 3; do k -n monitoring-test create service clusterip "m$i" --tcp=80 >/dev/null || die "creating a Service"; done
k -n monitoring-test create service clusterip static --tcp=80 --clusterip=198.18.242.200 >/dev/null || die "creating a Service with a requested address"
k -n monitoring-test delete service m1 >/dev/null
# For kube-proxy's metrics (the mixin's panels): an endpoint change the agent programs — a pod
# behind a Service, whose EndpointSlice carries the trigger time the network programming
# latency is measured from — and a POST of the agent's: the Event FailedToStartServiceHealthcheck
# for a health-check node port something else on the node already holds.
# shellcheck source=versions.env
. "$repo/scripts/versions.env"
k -n monitoring-test run web --image="registry.k8s.io/pause:$K8S_VERSION" --labels=app=web >/dev/null || die "creating the pod web"
k -n monitoring-test create service clusterip web --tcp=80 >/dev/null || die "creating the Service web"
hc_port=31999
# shellcheck disable=SC2016 # ($$, $1, $2: the inner shell's)
"$node" exec sh -c 'echo $$ > "$1/holder.pid"; exec python3 -c "import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"0.0.0.0\", $2)); s.listen(); time.sleep(3600)"' sh "$work" "$hc_port" &
d=$((SECONDS + 10)); until [ -s "$work/holder.pid" ] || [ $SECONDS -ge $d ]; do sleep 0.2; done
holder_pid=$(cat "$work/holder.pid" 2>/dev/null) || die "the port holder did not start"
k -n monitoring-test apply -f - >/dev/null <<YAML || die "creating the Service lb-local"
apiVersion: v1
kind: Service
metadata: {name: lb-local}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: $hc_port
  selector: {app: web}
  ports: [{port: 80}]
YAML
k -n monitoring-test wait --for=condition=Ready pod/web --timeout=180s >&2 || die "the pod web not Ready"
# The agent's /healthz, as a load balancer probes it (the kubelet probes /livez).
node_ip=$(k -n kube-system get pods -l app.kubernetes.io/name=clusterip-agent -o jsonpath='{.items[0].status.hostIP}')
"$node" exec curl -s --max-time 5 -o /dev/null "http://$node_ip:10256/healthz" || die "GET http://$node_ip:10256/healthz"

# ---------------------------------------------------------------- Prometheus
python3 "$helper" scrape-config "$mon/podmonitors.yaml" "$state/admin.kubeconfig" "$work/clusterip-rules.yaml" > "$work/prometheus.yml" ||
  die "making the Prometheus configuration from the PodMonitors"
"$promtool" check config "$work/prometheus.yml" >&2 || die "promtool check config"
prom=http://127.0.0.1:9090
# (node-cluster.sh exec runs `ip netns exec` as a child: Prometheus writes its own pid, and
# that is the process stopped at exit.)
"$node" exec sh -c 'echo $$ > "$1/prometheus.pid"; shift; exec "$@"' sh "$work" \
  "$PROMETHEUS_BIN/prometheus" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:9090 --log.level=warn > "$work/prometheus.log" 2>&1 &
wait_pid() { [ -s "$work/prometheus.pid" ]; }
d=$((SECONDS + 10)); until wait_pid || [ $SECONDS -ge $d ]; do sleep 0.2; done
prom_pid=$(cat "$work/prometheus.pid" 2>/dev/null) || die "Prometheus did not start: $(tail -5 "$work/prometheus.log")"
log "Prometheus $("$PROMETHEUS_BIN/prometheus" --version 2>&1 | head -1 | cut -d' ' -f3) (pid $prom_pid) in the node's network namespace; log $work/prometheus.log"

# query EXPR: the API's JSON answer (status success), or nothing.
query() { "$node" exec curl -sf --max-time 10 -G --data-urlencode "query=$1" "$prom/api/v1/query"; }
# series EXPR: how many series EXPR returns now.
series() { query "$1" | jq -r 'if .status == "success" then .data.result | length else 0 end' 2>/dev/null || echo 0; }
# until_ok SECS WHAT CMD…
until_ok() {
  local secs=$1 what=$2; shift 2
  local d=$((SECONDS + secs))
  until "$@"; do
    kill -0 "$prom_pid" 2>/dev/null || die "Prometheus exited: $(tail -5 "$work/prometheus.log")"
    [ $SECONDS -lt $d ] || { log "gave up waiting for $what after ${secs}s"; return 1; }
    sleep 2
  done
}
until_ok 60 "ready" "$node" exec curl -sf --max-time 5 -o /dev/null "$prom/-/ready" || die "Prometheus not ready within 60s: $(tail -5 "$work/prometheus.log")"

controllers=$(k -n clusterip-system get deployment clusterip-controller -o jsonpath='{.status.readyReplicas}')
agents=$(k get nodes -o name | wc -l)
all_up() {
  [ "$(series 'up{job="clusterip-controller"} == 1')" = "$controllers" ] && [ "$(series 'up{job="clusterip-agent"} == 1')" = "$agents" ]
}
until_ok 90 "up" all_up || die "not every target up within 90s: $(query 'up' | jq -c '[.data.result[] | {job: .metric.job, pod: .metric.pod, up: .value[1]}]'); targets: $("$node" exec curl -sf "$prom/api/v1/targets" | jq -c '[.data.activeTargets[] | {job: .labels.job, url: .scrapeUrl, health, lastError}]')"
query 'up{job=~"clusterip-controller|clusterip-agent"}' | jq -r '.data.result[] | "up{job=\"\(.metric.job)\",pod=\"\(.metric.pod)\"} = \(.value[1])"'
# rate() over [5m] needs two samples of each series: two scrape intervals more.
three_scrapes() { [ "$(series 'count_over_time(up{job="clusterip-agent"}[5m]) >= 3')" -ge 1 ]; }
until_ok 30 "three scrapes" three_scrapes || die "no third scrape of the agent within 30s"

fails=0
fail() { log "FAIL: $*"; fails=$((fails + 1)); }

# Every metric family each component exposes (its own /metrics: the # TYPE lines) has a series.
pod_ip=$(k -n clusterip-system get pods -l app.kubernetes.io/name=clusterip-controller -o jsonpath='{.items[0].status.podIP}')
families=0
for target in "clusterip-controller http://$pod_ip:8080/metrics" "clusterip-agent http://$node_ip:10249/metrics"; do
  read -r job url <<< "$target"
  ctype=$("$node" exec curl -sf --max-time 10 -o "$work/$job.metrics" -w '%{content_type}' "$url") || die "GET $url"
  [ "$ctype" = "application/openmetrics-text; version=1.0.0; charset=utf-8" ] || fail "$job: Content-Type '$ctype'"
  while read -r _ _ name type; do
    case "$type" in counter) re="${name}_total" ;; histogram) re="${name}_bucket" ;; *) re="$name" ;; esac
    n=$(series "{__name__=\"$re\",job=\"$job\"}")
    families=$((families + 1))
    if [ "$n" -gt 0 ]; then echo "$job $re: $n series"; else fail "$job: no series of the family $name ($type)"; fi
  done < <(grep '^# TYPE ' "$work/$job.metrics")
done
log "$families metric families checked"

# Every dashboard query returns a series.
queries=0
while IFS=$'\t' read -r title expr; do
  queries=$((queries + 1))
  n=$(series "$expr")
  if [ "$n" -gt 0 ]; then echo "dashboard '$title': $n series"; else fail "dashboard panel '$title': no series from $expr"; fi
done < <(python3 "$helper" dashboard-queries "$mon/dashboard.json")
log "$queries dashboard queries run"

# Every query of the kubernetes-mixin's kube-proxy dashboard, adapted to the agent's job.
mixin=$mon/tests/kube-proxy-mixin-queries.txt
event_posted() { [ -n "$(k -n monitoring-test get events --field-selector reason=FailedToStartServiceHealthcheck -o name)" ]; }
until_ok 60 "the agent's Event" event_posted || fail "no FailedToStartServiceHealthcheck Event for lb-local"
programmed() { [ "$(series 'kubeproxy_network_programming_duration_seconds_count{job="clusterip-agent"} > 0')" -ge 1 ]; }
until_ok 90 "a network programming observation" programmed || fail "no kubeproxy_network_programming_duration_seconds observation"
posted() { [ "$(series 'count_over_time(rest_client_request_duration_seconds_count{job="clusterip-agent",verb="POST"}[5m]) >= 2')" -ge 1 ]; }
until_ok 90 "two scrapes of the POST" posted || fail "the agent's POST not scraped twice"
mixin_queries=0
title=
while IFS= read -r line; do
  case "$line" in
    '## '*) title=${line#'## '} ;;
    'series: '* | 'evaluates: '*)
      kind=${line%%: *} expr=${line#*: }
      mixin_queries=$((mixin_queries + 1))
      answer=$(query "$expr") || { fail "mixin '$title': the query failed: $expr"; continue; }
      n=$(jq -r '.data.result | length' <<< "$answer")
      if [ "$kind" = evaluates ]; then
        echo "mixin '$title' (evaluates): $n series"
      elif [ "$n" -gt 0 ]; then
        echo "mixin '$title': $n series, $(jq -c '[.data.result[] | .value[1]]' <<< "$answer")"
      else
        fail "mixin panel '$title': no series from $expr"
      fi
      ;;
  esac
done < "$mixin"
[ "$mixin_queries" -ge 15 ] || fail "only $mixin_queries queries read from $mixin"
log "$mixin_queries kube-proxy mixin queries run"

# Every rule of the PrometheusRule is loaded and evaluates without error.
rules=$("$node" exec curl -sf --max-time 10 "$prom/api/v1/rules") || die "GET /api/v1/rules"
loaded=$(jq '[.data.groups[].rules[]] | length' <<< "$rules")
want=$(jq -rn --slurpfile r <(python3 -c 'import json,sys,yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))' "$work/clusterip-rules.yaml") '[$r[0].groups[].rules[]] | length')
[ "$loaded" = "$want" ] || fail "Prometheus loaded $loaded rules, the PrometheusRule has $want"
bad=$(jq -r '.data.groups[].rules[] | select(.health != "ok" and .health != "unknown") | "\(.name): \(.health) \(.lastError)"' <<< "$rules")
[ -z "$bad" ] || fail "rules that do not evaluate: $bad"
echo "rules: $loaded loaded; firing now: $(jq -r '[.data.groups[].rules[] | select(.state == "firing") | .name] | join(", ") | if . == "" then "none" else . end' <<< "$rules")"

[ "$fails" = 0 ] || die "$fails check(s) failed"
log "ok: both jobs up, $families metric families with data, $queries dashboard queries with data, $mixin_queries kube-proxy mixin queries, $loaded rules evaluating"
