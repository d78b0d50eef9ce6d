#!/usr/bin/env bash
# kubectl for the dev cluster: the harness-built kubectl (matching the apiserver) when the
# machine's is too old, and KUBECONFIG defaulting to the dev cluster's.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
export KUBECONFIG=${KUBECONFIG:-${CLUSTERIP_CLUSTER_DIR:-$repo/.cluster}/kubeconfig}
if [ -x "$K8S_BIN/kubectl" ]; then exec "$K8S_BIN/kubectl" "$@"; fi
exec kubectl "$@"
