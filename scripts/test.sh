#!/usr/bin/env bash
# The whole test suite: unit, property and integration tests of every crate in the
# workspace, against a real etcd + kube-apiserver started for this run (in a temporary
# state directory, so a dev cluster you have up is left alone) and stopped at the end.
#
#   scripts/test.sh                 everything
#   scripts/test.sh -p clusterip    extra arguments go to `cargo test` (those before `--`
#                                   also to the compile step, so only what runs is built)
#
# Integration tests that program nftables need root (they create network namespaces).
#
# Nothing this run starts outlives it: it first reaps what killed runs left behind, then
# puts itself into a pids cgroup of its own (scripts/lib/run.sh) that every process it starts
# inherits; its cluster is owned by it (a watchdog stops the cluster if this script is
# killed), and at the end whatever is still running in the cgroup is killed and named
# ("test: leftover process killed …"). INT/TERM/HUP end the run at once (the suite is
# killed, not waited for). If this script is SIGKILLed, the next `scripts/dev-cluster.sh
# reap` (or the next run) removes everything of this run.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. scripts/lib/run.sh

run_begin test
export CLUSTERIP_CLUSTER_DIR
CLUSTERIP_CLUSTER_DIR=$(owned_tmpdir test-cluster)
cleanup() {
  scripts/dev-cluster.sh down >/dev/null 2>&1 || true
  rm -rf "$CLUSTERIP_CLUSTER_DIR"
  run_end
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Debian packages the build and the tests need (protoc, nftables, iproute2, …): here, once
# (unless .ci/run or an enclosing run did), never from inside a test (dev-cluster.sh up skips
# it when this marker is set).
[ "${CLUSTERIP_PACKAGES_ENSURED:-}" = 1 ] || scripts/lib/ensure-packages.sh
export CLUSTERIP_PACKAGES_ENSURED=1

# Compile first (no cluster needed), so a build error shows before anything starts.
build_args=()
for a in "$@"; do [ "$a" = -- ] && break; build_args+=("$a"); done
# (Long steps run in the background and are waited for: bash runs a trap only once the
# foreground command has ended, so a TERM from a CI timeout would otherwise wait for the
# whole suite. `wait` returns at once on a signal; the EXIT trap then stops the cluster and
# run_end kills what is left in this run's cgroup.)
cargo test --workspace --no-run "${build_args[@]}" &
wait $!

CLUSTERIP_CONTROLLER=0 scripts/dev-cluster.sh up >/dev/null
export CLUSTERIP_TEST_CLUSTER=$CLUSTERIP_CLUSTER_DIR
export CLUSTERIP_KUBECONFIG=$CLUSTERIP_CLUSTER_DIR/kubeconfig

cargo test --workspace --no-fail-fast "$@" &
wait $!
