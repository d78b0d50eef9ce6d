#!/usr/bin/env bash
# Certificates for the clusterip admission webhook without cert-manager (the default path
# of deploy/), made with openssl: a CA and a serving certificate for the webhook Service, and
# a client CA and the kube-apiserver's client certificate for calling the webhook (the webhook
# answers nobody else), with the kube-apiserver's side of it (AdmissionConfiguration +
# kubeconfig) to install on the control-plane nodes.
#
#   scripts/gen-webhook-certs.sh                 # print the Secret and ConfigMap manifests (stdout)
#   scripts/gen-webhook-certs.sh --apply         # create/update the Secret and the ConfigMap in
#                                                # the cluster and patch the caBundle of both
#                                                # webhook configurations
#
# Install order with it (docs/operations.md, "Deploy"): the webhook configurations
# (failurePolicy: Fail) are registered last, once a controller replica is ready:
#   scripts/gen-webhook-certs.sh --apply   # namespace (if missing) + Secret clusterip-webhook-tls
#                                          # + ConfigMap clusterip-webhook-client-ca
#   kubectl apply -k deploy/ -l 'app.kubernetes.io/component!=admission-registration'
#   kubectl -n clusterip-system rollout status deploy/clusterip-controller
#   kubectl apply -k deploy/               # the webhook configurations
#   scripts/gen-webhook-certs.sh --apply   # again: the webhook configurations now exist → caBundle
#
# Files live in --dir (default ${XDG_STATE_HOME:-~/.local/state}/clusterip/webhook-certs/<namespace>):
#   ca.crt ca.key       the CA, made once and reused, so the caBundle stays the same when the
#                       serving certificate is renewed (run the script again to renew it)
#   tls.crt tls.key     the serving certificate (DNS names <service>.<namespace>.svc and
#                       <service>.<namespace>.svc.cluster.local), made fresh on every run
#   client-ca.crt client-ca.key
#                       the CA of the kube-apiserver's client certificate, made once and
#                       reused; its certificate goes into the ConfigMap clusterip-webhook-client-ca
#                       (the controller's --client-ca-file)
#   apiserver-webhook-client.crt apiserver-webhook-client.key
#                       the kube-apiserver's client certificate for the webhook (CN = the
#                       Deployment's --allowed-client-names), made fresh on every run
#   apiserver/admission-config.yaml apiserver/admission-kubeconfig.yaml
#                       for the kube-apiserver: copy both to --apiserver-config-dir on every
#                       control-plane node and start the apiserver with
#                       --admission-control-config-file=<that dir>/admission-config.yaml
#                       (docs/operations.md, "The kube-apiserver's side")
# --new-ca makes a new CA; the previous CA stays in the caBundle next to the new one, so the
# webhook is trusted throughout the rollover (run once more with --drop-previous-ca later).
#
# Options:
#   --namespace NS      controller namespace            (default clusterip-system)
#   --service NAME      webhook Service                 (default clusterip-webhook)
#   --secret NAME       Secret the Deployment mounts    (default clusterip-webhook-tls)
#   --webhook NAME      Mutating/ValidatingWebhookConfiguration name (default clusterip)
#   --days N            serving and client certificate lifetime (default 365; the CAs: 3650)
#   --client-name NAME  CN of the kube-apiserver's client certificate (default kube-apiserver-webhook-client)
#   --apiserver-config-dir DIR
#                       where the apiserver files will live on the control-plane nodes
#                       (default /etc/kubernetes/clusterip)
#   --dir DIR           where the key material is kept
#   --new-ca            make a new CA even if one exists in --dir
#   --drop-previous-ca  leave the previous CA out of the caBundle
#   --apply             write to the cluster (kubectl; KUBECONFIG or --kubeconfig)
#   --kubeconfig PATH   kubeconfig for --apply
#   --print-ca-bundle   print only the base64 caBundle (stdout) and exit after generating
# Needs openssl (and kubectl for --apply). Private keys never leave --dir except into the Secret.
set -euo pipefail

namespace=clusterip-system
service=clusterip-webhook
secret=clusterip-webhook-tls
client_ca_configmap=clusterip-webhook-client-ca
client_name=kube-apiserver-webhook-client
apiserver_config_dir=/etc/kubernetes/clusterip
webhook=clusterip
days=365
ca_days=3650
dir=
new_ca=0
drop_previous=0
apply=0
print_ca_bundle=0
kubectl=(kubectl)

die() { echo "gen-webhook-certs: $*" >&2; exit 1; }
log() { echo "gen-webhook-certs: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --namespace) namespace=${2:?}; shift 2 ;;
    --service) service=${2:?}; shift 2 ;;
    --secret) secret=${2:?}; shift 2 ;;
    --webhook) webhook=${2:?}; shift 2 ;;
    --days) days=${2:?}; shift 2 ;;
    --client-name) client_name=${2:?}; shift 2 ;;
    --apiserver-config-dir) apiserver_config_dir=${2:?}; shift 2 ;;
    --dir) dir=${2:?}; shift 2 ;;
    --new-ca) new_ca=1; shift ;;
    --drop-previous-ca) drop_previous=1; shift ;;
    --apply) apply=1; shift ;;
    --kubeconfig) kubectl=(kubectl --kubeconfig "${2:?}"); shift 2 ;;
    --print-ca-bundle) print_ca_bundle=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gen-webhook-certs: unknown argument: $1" >&2; usage 2 ;;
  esac
done
case "$days" in ''|*[!0-9]*) die "--days wants a whole number of days, got '$days'" ;; esac
command -v openssl >/dev/null || die "openssl not found; install it (Debian: apt-get install openssl)"
if [ "$apply" = 1 ]; then
  # Prefer the kubectl this repository's dev cluster uses when there is no kubectl on PATH.
  if ! command -v kubectl >/dev/null; then
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    kubectl=("$repo/scripts/kubectl.sh" "${kubectl[@]:1}")
  fi
fi

dir=${dir:-${XDG_STATE_HOME:-$HOME/.local/state}/clusterip/webhook-certs/$namespace}
mkdir -p "$dir"
chmod 700 "$dir"
umask 077

dns1="$service.$namespace.svc"
dns2="$service.$namespace.svc.cluster.local"

# The CA: reused unless absent or --new-ca.
if [ "$new_ca" = 1 ] || [ ! -s "$dir/ca.crt" ] || [ ! -s "$dir/ca.key" ]; then
  if [ -s "$dir/ca.crt" ]; then
    cp "$dir/ca.crt" "$dir/ca-previous.crt"
    log "keeping the previous CA in the caBundle during the rollover ($dir/ca-previous.crt)"
  fi
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$dir/ca.key" -sha256 -days "$ca_days" \
    -subj "/CN=clusterip-webhook-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.crt"
  log "made a CA in $dir (valid $ca_days days)"
fi
[ "$drop_previous" = 1 ] && rm -f "$dir/ca-previous.crt"

# The serving certificate, signed by the CA.
openssl ecparam -name prime256v1 -genkey -noout -out "$dir/tls.key" 2>/dev/null
openssl req -new -key "$dir/tls.key" -subj "/CN=$dns1" -out "$dir/tls.csr"
cat > "$dir/tls.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:$dns1,DNS:$dns2
EOF
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -days "$days" -sha256 -extfile "$dir/tls.ext" -out "$dir/tls.crt" 2>/dev/null
rm -f "$dir/tls.csr" "$dir/tls.ext"
openssl verify -CAfile "$dir/ca.crt" "$dir/tls.crt" >/dev/null || die "the new serving certificate does not verify against $dir/ca.crt"
log "made a serving certificate for $dns1, $dns2 (valid $days days)"

# The client CA (made once) and the kube-apiserver's client certificate for the webhook.
if [ ! -s "$dir/client-ca.crt" ] || [ ! -s "$dir/client-ca.key" ]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/client-ca.key" 2>/dev/null
  openssl req -x509 -new -key "$dir/client-ca.key" -sha256 -days "$ca_days" \
    -subj "/CN=clusterip-webhook-client-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/client-ca.crt"
  log "made a client CA in $dir (valid $ca_days days)"
fi
openssl ecparam -name prime256v1 -genkey -noout -out "$dir/apiserver-webhook-client.key" 2>/dev/null
openssl req -new -key "$dir/apiserver-webhook-client.key" -subj "/CN=$client_name" -out "$dir/client.csr"
cat > "$dir/client.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth
EOF
openssl x509 -req -in "$dir/client.csr" -CA "$dir/client-ca.crt" -CAkey "$dir/client-ca.key" -CAcreateserial \
  -days "$days" -sha256 -extfile "$dir/client.ext" -out "$dir/apiserver-webhook-client.crt" 2>/dev/null
rm -f "$dir/client.csr" "$dir/client.ext"
openssl verify -CAfile "$dir/client-ca.crt" "$dir/apiserver-webhook-client.crt" >/dev/null ||
  die "the new client certificate does not verify against $dir/client-ca.crt"
log "made the kube-apiserver's client certificate for the webhook (CN $client_name, valid $days days)"

# The kube-apiserver's side: both webhook admission plugins present the certificate to the
# webhook Service (users[].name: the webhook's host, <service>.<namespace>.svc, port 443).
mkdir -p "$dir/apiserver"
cat > "$dir/apiserver/admission-kubeconfig.yaml" <<EOF
apiVersion: v1
kind: Config
users:
- name: $dns1
  user:
    client-certificate-data: $(base64 -w0 < "$dir/apiserver-webhook-client.crt")
    client-key-data: $(base64 -w0 < "$dir/apiserver-webhook-client.key")
- name: $dns1:443
  user:
    client-certificate-data: $(base64 -w0 < "$dir/apiserver-webhook-client.crt")
    client-key-data: $(base64 -w0 < "$dir/apiserver-webhook-client.key")
EOF
cat > "$dir/apiserver/admission-config.yaml" <<EOF
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
- name: MutatingAdmissionWebhook
  configuration:
    apiVersion: apiserver.config.k8s.io/v1
    kind: WebhookAdmissionConfiguration
    kubeConfigFile: $apiserver_config_dir/admission-kubeconfig.yaml
- name: ValidatingAdmissionWebhook
  configuration:
    apiVersion: apiserver.config.k8s.io/v1
    kind: WebhookAdmissionConfiguration
    kubeConfigFile: $apiserver_config_dir/admission-kubeconfig.yaml
EOF
log "wrote the kube-apiserver's AdmissionConfiguration and kubeconfig to $dir/apiserver/ (install them under $apiserver_config_dir)"

# What the apiserver trusts: the CA, plus the previous one during a CA rollover.
cat "$dir/ca.crt" > "$dir/ca-bundle.crt"
[ -s "$dir/ca-previous.crt" ] && cat "$dir/ca-previous.crt" >> "$dir/ca-bundle.crt"
ca_bundle=$(base64 -w0 < "$dir/ca-bundle.crt")

if [ "$print_ca_bundle" = 1 ]; then
  echo "$ca_bundle"
  exit 0
fi

secret_manifest() {
  cat <<EOF
apiVersion: v1
kind: Secret
metadata:
  name: $secret
  namespace: $namespace
  labels:
    app.kubernetes.io/name: clusterip-controller
    app.kubernetes.io/part-of: clusterip
type: kubernetes.io/tls
data:
  tls.crt: $(base64 -w0 < "$dir/tls.crt")
  tls.key: $(base64 -w0 < "$dir/tls.key")
  ca.crt: $(base64 -w0 < "$dir/ca-bundle.crt")
---
# The CA of the kube-apiserver's client certificate (the controller's --client-ca-file).
apiVersion: v1
kind: ConfigMap
metadata:
  name: $client_ca_configmap
  namespace: $namespace
  labels:
    app.kubernetes.io/name: clusterip-controller
    app.kubernetes.io/part-of: clusterip
data:
  ca.crt: |
$(sed 's/^/    /' "$dir/client-ca.crt")
EOF
}

# caBundle of every webhook in one configuration (a JSON patch per webhook index).
patch_ca_bundle() {
  local kind=$1 names n i ops=""
  if ! names=$("${kubectl[@]}" get "$kind" "$webhook" -o jsonpath='{range .webhooks[*]}{.name}{"\n"}{end}' 2>/dev/null); then
    log "$kind/$webhook is not registered yet (expected on the first run)"
    return 1
  fi
  n=$(printf '%s\n' "$names" | grep -c .)
  for ((i = 0; i < n; i++)); do
    ops+="${ops:+,}{\"op\":\"add\",\"path\":\"/webhooks/$i/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}"
  done
  "${kubectl[@]}" patch "$kind" "$webhook" --type=json -p "[$ops]" >/dev/null
  log "patched the caBundle of $kind/$webhook ($n webhook(s))"
}

if [ "$apply" = 0 ]; then
  secret_manifest
  cat >&2 <<EOF
gen-webhook-certs: the Secret and ConfigMap manifests are on stdout (kubectl apply -f - them). Then set the
gen-webhook-certs: caBundle of both webhook configurations (or rerun with --apply):
gen-webhook-certs:   kubectl patch mutatingwebhookconfiguration $webhook --type=json -p '[{"op":"add","path":"/webhooks/0/clientConfig/caBundle","value":"<caBundle>"}]'
gen-webhook-certs:   kubectl patch validatingwebhookconfiguration $webhook --type=json -p '[{"op":"add","path":"/webhooks/0/clientConfig/caBundle","value":"<caBundle>"}]'
gen-webhook-certs: caBundle (also: --print-ca-bundle): $ca_bundle
EOF
  exit 0
fi

if ! "${kubectl[@]}" get namespace "$namespace" >/dev/null 2>&1; then
  "${kubectl[@]}" create namespace "$namespace" >/dev/null
  log "created namespace $namespace ('kubectl apply -k deploy/' adds its labels)"
fi
secret_manifest | "${kubectl[@]}" apply -f - >/dev/null
log "Secret $namespace/$secret and ConfigMap $namespace/$client_ca_configmap applied (the controller re-reads the files once the kubelet updates the volumes, within about a minute)"
log "the kube-apiserver must present $dir/apiserver-webhook-client.crt: install $dir/apiserver/* under $apiserver_config_dir on the control-plane nodes (docs/operations.md)"
missing=0
patch_ca_bundle mutatingwebhookconfiguration || missing=1
patch_ca_bundle validatingwebhookconfiguration || missing=1
if [ "$missing" = 1 ]; then
  log "caBundle not (fully) set yet. Register the webhooks once a replica is ready (one registered before"
  log "that, or without its caBundle, fails Service creates outside kube-system/$namespace):"
  log "  kubectl apply -k deploy/ -l 'app.kubernetes.io/component!=admission-registration'"
  log "  kubectl -n $namespace rollout status deploy/clusterip-controller"
  log "  kubectl apply -k deploy/   # then this script with --apply again"
fi
exit 0
