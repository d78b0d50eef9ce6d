#!/usr/bin/env bash
# The container images Kubernetes' e2e suite runs in the Service tests, built here from
# source and Debian packages (no registry is reachable), under the exact names the suite's
# e2e.test asks for, and — with --load — imported into the running node's containerd.
#
#   scripts/lib/build-e2e-images.sh [--load]     (--load: build only what has no archive,
#                                                 then import them all into the node)
#
# The names come from `e2e.test --list-images` (written to target/images/e2e/list-images.txt);
# scripts/build-images.sh builds each (targets e2e-agnhost, e2e-busybox, e2e-pause,
# e2e-regression-issue-74839) into
# target/images/e2e/<name>.oci.tar, and this fails when what it built is not a name the
# suite lists (a version bump of the module changes them). --load: `scripts/node-cluster.sh
# load-images target/images/e2e` (CLUSTERIP_NODE_DIR names the node, as for node-cluster.sh).
#
# What is built, and how faithful it is (docs/conformance.md):
#   agnhost   test/images/agnhost of the same Kubernetes module, on Debian minbase with the
#             tools its Dockerfile installs; without CoreDNS and the fake registry's content
#   busybox   Debian's busybox-static alone in an image (Debian's release of busybox, not
#             1.37.0: the nearest thing made from Debian packages)
#   pause     the node's pause image (Kubernetes' build/pause of the same release) under the
#             suite's pause name
#   regression-issue-74839   test/images/regression-issue-74839 of the same module (the
#             conntrack test's prober) on Debian bookworm minbase, as upstream's debian-base
#   coredns   not named by the suite but expected of the cluster (it resolves Service names):
#             CoreDNS v<COREDNS_VERSION>, kubeadm's, as registry.k8s.io/coredns/coredns
#             (`scripts/node-cluster.sh dns` deploys it)
# Not built: nginx (no selected test runs it), and every other image the list names.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
builder=$repo/scripts/lib/build-go-binaries.sh
out=$repo/target/images/e2e

log() { echo "build-e2e-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

load=
case "${1:-}" in
  --load) load=1 ;;
  "") ;;
  *) echo "usage: $0 [--load]" >&2; exit 2 ;;
esac

"$builder" e2e.test
eval "$("$builder" print-dirs)"
mkdir -p "$out"
"$K8S_BIN/e2e.test" --list-images > "$out/list-images.txt.tmp"
mv "$out/list-images.txt.tmp" "$out/list-images.txt"

# newest NAME: the newest tag of image NAME in the list (agnhost is listed twice: the
# current one and the "previous" 2.55 a few tests use; busybox twice: the suite's own
# 1.37.0-2 and 1.36.1-1 of a storage test's manifest), or fail.
newest() {
  local ref
  ref=$(grep -E "^[^ ]*/$1:[^ ]+$" "$out/list-images.txt" | sort -V | tail -n 1)
  [ -n "$ref" ] || die "e2e.test --list-images does not name '$1'"
  echo "$ref"
}
agnhost=$(newest e2e-test-images/agnhost)
busybox=$(newest e2e-test-images/busybox)
pause=$(newest pause)
regression=$(newest e2e-test-images/regression-issue-74839)
log "the suite pulls $agnhost, $busybox, $pause, $regression"

# (--load builds only what has no archive yet.)
build=()
for i in e2e-agnhost e2e-busybox e2e-pause e2e-regression-issue-74839 coredns; do
  [ -n "$load" ] && [ -f "$out/${i#e2e-}.oci.tar" ] || build+=("$i")
done
[ ${#build[@]} = 0 ] || E2E_BUSYBOX_TAG=${busybox##*:} E2E_PAUSE_TAG=${pause##*:} \
  "$repo/scripts/build-images.sh" "${build[@]}"

# What was built is what the suite pulls (the archive's own reference name).
for pair in "agnhost $agnhost" "busybox $busybox" "pause $pause" "regression-issue-74839 $regression"; do
  read -r file ref <<< "$pair"
  name=$(tar -xOf "$out/$file.oci.tar" index.json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])')
  [ "$name" = "$ref" ] || die "target/images/e2e/$file.oci.tar is $name, the suite pulls $ref"
done

if [ -n "$load" ]; then
  "$repo/scripts/node-cluster.sh" load-images "$out"
  log "loaded into the node: $agnhost $busybox $pause $regression and CoreDNS"
fi
