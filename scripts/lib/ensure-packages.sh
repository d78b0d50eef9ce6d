#!/usr/bin/env bash
# Installs the Debian packages the harness and the tests need, when they are missing:
# protoc (etcd-client's build), nftables/iptables/iproute2/conntrack (the node agent's tests),
# openssl/curl/jq (certificates, probes, benchmarks). As root with apt-get it installs them;
# otherwise it names them and fails. Used by .ci/run, scripts/test.sh, scripts/test-soak.sh
# (stress-ng) and `scripts/dev-cluster.sh up`, so the README's commands work on a fresh
# machine — never from inside a test: scripts/test.sh exports CLUSTERIP_PACKAGES_ENSURED=1
# (tests/support sets it too) and `up` then skips it.
#
#   scripts/lib/ensure-packages.sh [PACKAGE ...]   # default: the full list below
set -euo pipefail
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || pkgs=(protobuf-compiler nftables iptables iproute2 conntrack openssl curl ca-certificates jq git build-essential pkg-config util-linux)
need=()
for pkg in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "ensure-packages: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
else
  echo "ensure-packages: missing Debian packages: ${need[*]} (install them: apt-get install ${need[*]})" >&2
  exit 1
fi
