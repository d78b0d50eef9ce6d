#!/usr/bin/env bash
# The whole test suite: unit, property and integration tests of every crate in the
# workspace, against a real etcd + kube-apiserver started for this run (in a temporary
# state directory, so a dev cluster you have up is left alone) and stopped at the end.
#
#   scripts/test.sh                 everything
#   scripts/test.sh -p clusterip    extra arguments go to `cargo test`
#
# Integration tests that program nftables need root (they create network namespaces).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/clusterip-test-cluster.XXXXXX")
cleanup() { scripts/dev-cluster.sh down >/dev/null 2>&1 || true; rm -rf "$CLUSTERIP_CLUSTER_DIR"; }
trap cleanup EXIT INT TERM

# Debian packages the build and the tests need (protoc, nftables, iproute2, …).
scripts/lib/ensure-packages.sh

# Compile first (no cluster needed), so a build error shows before anything starts.
cargo test --workspace --no-run

CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >/dev/null
export CLUSTERIP_TEST_CLUSTER=$CLUSTERIP_CLUSTER_DIR
export CLUSTERIP_KUBECONFIG=$CLUSTERIP_CLUSTER_DIR/kubeconfig

cargo test --workspace --no-fail-fast "$@"
