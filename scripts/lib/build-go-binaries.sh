#!/usr/bin/env bash
# Builds the Go-made real parts (kube-apiserver, kubectl, kube-proxy, etcd) from Go modules
# into a cache directory keyed by version, once per machine.
#
#   scripts/lib/build-go-binaries.sh kube-apiserver|kubectl|kube-proxy|etcd|ipallocbench ...
#   scripts/lib/build-go-binaries.sh k8s-module     the wrapper module's directory, on stdout
#   scripts/lib/build-go-binaries.sh print-dirs     K8S_BIN=… and ETCD_BIN=… lines
#
# Prints nothing but progress on stderr; the binaries land in the K8S_BIN / ETCD_BIN dirs.
# CLUSTERIP_CACHE overrides the cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/clusterip).
#
# Builds are serialised per cache root: whatever is missing is built under an exclusive
# flock on <cache root>/.build.lock, so two cold starts at once never build into (or delete)
# the same module directory; the second waits, then finds the binaries there. A binary is
# moved into place only when complete (<name>.tmp, then mv).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../versions.env
. "$here/../versions.env"

cache_root=${CLUSTERIP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/clusterip}
k8s_dir="$cache_root/kubernetes-v$K8S_VERSION"
etcd_dir="$cache_root/etcd-v$ETCD_VERSION"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

log() { echo "build-go-binaries: $*" >&2; }

# Take the cache's build lock (once per invocation); say so when another build holds it.
locked=
lock_cache() {
  [ -n "$locked" ] && return 0
  mkdir -p "$cache_root"
  exec 8>"$cache_root/.build.lock"
  if ! flock -n 8; then
    log "another build holds $cache_root/.build.lock; waiting for it"
    flock 8
  fi
  locked=1
}

# A wrapper module that requires k8s.io/kubernetes and points every k8s.io staging module
# (listed in kubernetes' own go.mod as "=> ./staging/src/...") at its published v0.x.y.
k8s_module() {
  local mod="$k8s_dir/src"
  [ -f "$mod/.ready" ] && { echo "$mod"; return; }
  lock_cache
  # (Another build may have finished it while we waited for the lock.)
  [ -f "$mod/.ready" ] && { echo "$mod"; return; }
  rm -rf "$mod"; mkdir -p "$mod"
  local minor=${K8S_VERSION#1.}
  local staging="0.$minor"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/k8sbuild

go 1.26
MOD
    go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" >/dev/null
    local upstream_mod
    upstream_mod=$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/v$K8S_VERSION.mod
    {
      echo "require k8s.io/kubernetes v$K8S_VERSION"
      echo "replace ("
      grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging/src/k8s\.io/[a-z0-9-]+' "$upstream_mod" |
        awk -v v="v$staging" '{print "\t" $1 " => " $1 " " v}'
      echo ")"
    } >> go.mod
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    log "resolving Kubernetes v$K8S_VERSION modules (first time only)"
    go mod tidy >&2
  )
  touch "$mod/.ready"
  echo "$mod"
}

build_k8s() {
  local name=$1 out="$k8s_dir/bin/$1"
  [ -x "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && return 0
  local mod; mod=$(k8s_module)
  mkdir -p "$k8s_dir/bin"
  log "building $name v$K8S_VERSION from Go modules (slow the first time; cached in $k8s_dir)"
  ( cd "$mod" && go build -trimpath -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
      -X k8s.io/component-base/version.gitMajor=1 \
      -X k8s.io/component-base/version.gitMinor=${K8S_VERSION#1.} \
      -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION" \
      -o "$out.tmp" "k8s.io/kubernetes/cmd/$name" ) >&2
  mv "$out.tmp" "$out"
}

build_etcd() {
  local out="$etcd_dir/bin/etcd"
  [ -x "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && return 0
  local mod="$etcd_dir/src"
  rm -rf "$mod"; mkdir -p "$mod" "$etcd_dir/bin"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/etcdbuild

go 1.26

require go.etcd.io/etcd/server/v3 v$ETCD_VERSION
MOD
    cat > main.go <<'GO'
// Command etcd: etcd's own server main, built from its published Go module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    log "building etcd v$ETCD_VERSION from Go modules (cached in $etcd_dir)"
    go mod tidy >&2
    go build -trimpath -ldflags "-s -w" -o "$out.tmp" . >&2
  )
  mv "$out.tmp" "$out"
}

# Kubernetes' ipallocator benchmark (scripts/bench-allocator.sh), built inside the wrapper
# module (it pins every k8s.io staging module); rebuilt when its source is newer.
build_ipallocbench() {
  local src="$here/../../benches/k8s-ipallocator/main.go" out="$k8s_dir/bin/ipallocbench"
  [ -x "$out" ] && [ ! "$src" -nt "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && [ ! "$src" -nt "$out" ] && return 0
  local mod; mod=$(k8s_module)
  mkdir -p "$mod/cmd/ipallocbench" "$k8s_dir/bin"
  cp "$src" "$mod/cmd/ipallocbench/main.go"
  log "building Kubernetes' ipallocator benchmark (v$K8S_VERSION)"
  (cd "$mod" && go build -trimpath -o "$out.tmp" ./cmd/ipallocbench) >&2
  mv "$out.tmp" "$out"
}

for what in "$@"; do
  case "$what" in
    kube-apiserver|kubectl|kube-proxy) build_k8s "$what" ;;
    ipallocbench) build_ipallocbench ;;
    etcd) build_etcd ;;
    k8s-module) k8s_module ;;
    print-dirs) echo "K8S_BIN=$k8s_dir/bin"; echo "ETCD_BIN=$etcd_dir/bin" ;;
    *) echo "build-go-binaries: unknown binary '$what'" >&2; exit 2 ;;
  esac
done
