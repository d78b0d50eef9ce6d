#!/usr/bin/env bash
# Builds the Go-made real parts (kube-apiserver, kubectl, kube-proxy, etcd) from Go modules
# into a cache directory keyed by version, once per machine.
#
#   scripts/lib/build-go-binaries.sh kube-apiserver|kubectl|kube-proxy|etcd|ipallocbench ...
#   scripts/lib/build-go-binaries.sh kubelet|kube-controller-manager|kube-scheduler ...
#   scripts/lib/build-go-binaries.sh containerd|cni-plugins|pause   (the one-node cluster's parts)
#   scripts/lib/build-go-binaries.sh coredns      the node's cluster DNS (scripts/conformance.sh)
#   scripts/lib/build-go-binaries.sh e2e.test|agnhost|regression-issue-74839   Kubernetes' e2e
#                                   suite (`go test -c` of k8s.io/kubernetes/test/e2e) and its
#                                   test images' programs
#                                   (scripts/conformance.sh, scripts/lib/build-e2e-images.sh)
#   scripts/lib/build-go-binaries.sh ginkgo   the ginkgo CLI at the version the e2e suite links
#                                   (runs e2e.test in parallel: scripts/conformance.sh --procs)
#   scripts/lib/build-go-binaries.sh prometheus|promtool   Prometheus v3 and its rule tester
#                                   (scripts/test-monitoring.sh), without the web UI's assets
#   scripts/lib/build-go-binaries.sh prometheus-operator-crds   the operator's CRDs (ServiceMonitor,
#                                   PodMonitor, PrometheusRule, …) from its Go module, into
#                                   PROMETHEUS_OPERATOR_CRDS (the dry-run of deploy/monitoring)
#   scripts/lib/build-go-binaries.sh k8s-module     the wrapper module's directory, on stdout
#   scripts/lib/build-go-binaries.sh print-dirs     K8S_BIN=…, ETCD_BIN=…, CONTAINERD_BIN=…,
#                                                   CNI_BIN=…, PAUSE_BIN=…, COREDNS_BIN=…,
#                                                   PROMETHEUS_BIN=… and PROMETHEUS_OPERATOR_CRDS=… lines
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
containerd_dir="$cache_root/containerd-v$CONTAINERD_VERSION"
cni_dir="$cache_root/cni-plugins-v$CNI_PLUGINS_VERSION"
pause_dir="$cache_root/pause-v$K8S_VERSION"
coredns_dir="$cache_root/coredns-v$COREDNS_VERSION"
prometheus_dir="$cache_root/prometheus-v$PROMETHEUS_VERSION"
operator_dir="$cache_root/prometheus-operator-v$PROMETHEUS_OPERATOR_VERSION"
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
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
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
  ( cd "$mod" && go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out.tmp" "k8s.io/kubernetes/cmd/$name" ) >&2
  mv "$out.tmp" "$out"
}

# The e2e suite and agnhost resolve in the same wrapper module (same requires, same staging
# replace lines): test/e2e, agnhost and what e2e_test.go imports are added to it once, in a
# second tools file, and the module tidied again (marker .ready-e2e). Every package comes from
# kubernetes' own go.mod, so the versions the other binaries were built with do not move.
k8s_e2e_module() {
  local mod; mod=$(k8s_module)
  [ -f "$mod/.ready-e2e" ] && { echo "$mod"; return; }
  lock_cache
  [ -f "$mod/.ready-e2e" ] && { echo "$mod"; return; }
  ( cd "$mod"
    rm -f .ready
    write_tools() {
      { printf '//go:build tools\n\npackage tools\n\nimport (\n'
        printf '\t_ "%s"\n' "$@"
        printf ')\n'; } > tools_e2e.go
    }
    write_tools k8s.io/kubernetes/test/e2e k8s.io/kubernetes/test/images/agnhost
    log "resolving Kubernetes v$K8S_VERSION's e2e suite in the wrapper module (first time only)"
    go mod tidy >&2
    # (tidy follows the tests of the main module's packages only: add what e2e_test.go imports.)
    local imports
    mapfile -t imports < <(go list -f '{{join .TestImports "\n"}}' k8s.io/kubernetes/test/e2e | grep '\.' | sort -u)
    write_tools k8s.io/kubernetes/test/e2e k8s.io/kubernetes/test/images/agnhost "${imports[@]}"
    go mod tidy >&2
    touch .ready .ready-e2e
  )
  echo "$mod"
}

# The Kubernetes version stamped into what is built from the wrapper module.
k8s_ldflags() {
  echo "-s -w \
      -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
      -X k8s.io/component-base/version.gitMajor=1 \
      -X k8s.io/component-base/version.gitMinor=${K8S_VERSION#1.} \
      -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION"
}

# e2e.test: Kubernetes' own e2e suite, `go test -c` of k8s.io/kubernetes/test/e2e (its
# manifests and conformance list are embedded: no repository checkout is needed to run it).
build_e2e_test() {
  local out="$k8s_dir/bin/e2e.test"
  [ -x "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && return 0
  local mod; mod=$(k8s_e2e_module)
  mkdir -p "$k8s_dir/bin"
  log "building e2e.test v$K8S_VERSION from Go modules (slow the first time; cached in $k8s_dir)"
  ( cd "$mod" && go test -c -trimpath -ldflags "$(k8s_ldflags)" -o "$out.tmp" k8s.io/kubernetes/test/e2e ) >&2
  mv "$out.tmp" "$out"
}

# ginkgo: the CLI that runs a compiled suite on several processes (its parallel protocol is
# the suite's own library, so the CLI's version is the one e2e.test links: the wrapper
# module's requirement). A module of its own: the CLI's dependencies (x/tools, pprof) are not
# the suite's, and must not move the wrapper module's versions.
build_ginkgo() {
  local mod; mod=$(k8s_e2e_module)
  local v; v=$(cd "$mod" && go list -m -f '{{.Version}}' github.com/onsi/ginkgo/v2)
  local out="$k8s_dir/bin/ginkgo"
  [ -x "$out" ] && [ "$(cat "$out.version" 2>/dev/null)" = "$v" ] && return 0
  lock_cache
  [ -x "$out" ] && [ "$(cat "$out.version" 2>/dev/null)" = "$v" ] && return 0
  local src="$k8s_dir/ginkgo-src"
  rm -rf "$src"; mkdir -p "$src" "$k8s_dir/bin"
  ( cd "$src"
    printf 'module clusterip.local/ginkgobuild\n\ngo 1.26\n\nrequire github.com/onsi/ginkgo/v2 %s\n' "$v" > go.mod
    printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/onsi/ginkgo/v2/ginkgo"\n' > tools.go
    log "building the ginkgo CLI $v (the e2e suite's version) from Go modules"
    go mod tidy >&2
    go build -trimpath -ldflags "-s -w" -o "$out.tmp" github.com/onsi/ginkgo/v2/ginkgo >&2 )
  mv "$out.tmp" "$out"
  echo "$v" > "$out.version"
}

# The e2e suite's test images' programs (test/images/<name>, main packages of the same
# module): agnhost, its all-purpose test server, and regression-issue-74839, the conntrack
# test's raw-socket prober. An image's version is test/images/<name>/VERSION of the module.
build_e2e_image_binary() {
  local name=$1 out="$k8s_dir/bin/$1"
  [ -x "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && return 0
  local mod; mod=$(k8s_e2e_module)
  mkdir -p "$k8s_dir/bin"
  log "building $name (Kubernetes v$K8S_VERSION's test/images/$name) from Go modules"
  ( cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$out.tmp" "k8s.io/kubernetes/test/images/$name" ) >&2
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

# containerd (daemon, and its shim for runc) from its published Go module: the CRI plugin is
# part of the daemon. No btrfs/devmapper snapshotters (cgo-free build: overlayfs and native).
build_containerd() {
  local out="$containerd_dir/bin"
  [ -x "$out/containerd" ] && [ -x "$out/containerd-shim-runc-v2" ] && [ -x "$out/ctr" ] && return 0
  lock_cache
  [ -x "$out/containerd" ] && [ -x "$out/containerd-shim-runc-v2" ] && [ -x "$out/ctr" ] && return 0
  local mod="$containerd_dir/src" c
  rm -rf "$mod"; mkdir -p "$mod" "$out"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/containerdbuild

go 1.26

require github.com/containerd/containerd/v2 v$CONTAINERD_VERSION
MOD
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
GO
    log "building containerd v$CONTAINERD_VERSION from Go modules (cached in $containerd_dir)"
    go mod tidy >&2
    for c in containerd containerd-shim-runc-v2 ctr; do
      go build -trimpath -tags "no_btrfs no_devmapper no_zfs no_aufs" -ldflags "-s -w \
          -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION" \
          -o "$out/$c.tmp" "github.com/containerd/containerd/v2/cmd/$c" >&2
      mv "$out/$c.tmp" "$out/$c"
    done
  )
}

# The CNI plugins the node's network needs (ptp, host-local, loopback, portmap; bridge too).
build_cni_plugins() {
  local out="$cni_dir/bin" p all=1
  for p in bridge host-local loopback portmap ptp; do [ -x "$out/$p" ] || all=; done
  [ -n "$all" ] && return 0
  lock_cache
  local mod="$cni_dir/src"
  rm -rf "$mod"; mkdir -p "$mod" "$out"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/cnibuild

go 1.26

require github.com/containernetworking/plugins v$CNI_PLUGINS_VERSION
MOD
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/main/ptp"
	_ "github.com/containernetworking/plugins/plugins/meta/portmap"
)
GO
    log "building CNI plugins v$CNI_PLUGINS_VERSION from Go modules (cached in $cni_dir)"
    go mod tidy >&2
    for p in ipam/host-local main/bridge main/loopback main/ptp meta/portmap; do
      go build -trimpath -ldflags "-s -w" -o "$out/${p#*/}.tmp" "github.com/containernetworking/plugins/plugins/$p" >&2
      mv "$out/${p#*/}.tmp" "$out/${p#*/}"
    done
  )
}

# CoreDNS, its own main package (the repository root: every plugin of its plugin.cfg).
build_coredns() {
  local out="$coredns_dir/bin/coredns"
  [ -x "$out" ] && return 0
  lock_cache
  [ -x "$out" ] && return 0
  local mod="$coredns_dir/src"
  rm -rf "$mod"; mkdir -p "$mod" "$coredns_dir/bin"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/corednsbuild

go 1.26

require github.com/coredns/coredns v$COREDNS_VERSION
MOD
    cat > tools.go <<'GO'
//go:build tools

package tools

import _ "github.com/coredns/coredns"
GO
    log "building CoreDNS v$COREDNS_VERSION from Go modules (cached in $coredns_dir)"
    go mod tidy >&2
    go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=v$COREDNS_VERSION" \
      -o "$out.tmp" github.com/coredns/coredns >&2
  )
  mv "$out.tmp" "$out"
}

# Prometheus v3 and promtool from github.com/prometheus/prometheus, whose Go module versions
# for Prometheus 3.x.y are v0.3xx.y (3.9.1 is v0.309.1). Built without the `builtinassets` tag:
# the web UI's compiled assets are made by npm and are not in the Go module, so the server
# answers its HTTP API (all the tests use) and no UI pages.
build_prometheus() {
  local out="$prometheus_dir/bin"
  [ -x "$out/prometheus" ] && [ -x "$out/promtool" ] && return 0
  lock_cache
  [ -x "$out/prometheus" ] && [ -x "$out/promtool" ] && return 0
  local major=${PROMETHEUS_VERSION%%.*} rest=${PROMETHEUS_VERSION#*.}
  local modv="v0.$((major * 100 + ${rest%%.*})).${rest#*.}"
  local mod="$prometheus_dir/src" c
  rm -rf "$mod"; mkdir -p "$mod" "$out"
  ( cd "$mod"
    cat > go.mod <<MOD
module clusterip.local/prometheusbuild

go 1.26

require github.com/prometheus/prometheus $modv
MOD
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
GO
    log "building Prometheus v$PROMETHEUS_VERSION ($modv) and promtool from Go modules (cached in $prometheus_dir)"
    go mod tidy >&2
    for c in prometheus promtool; do
      go build -trimpath -ldflags "-s -w \
          -X github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION \
          -X github.com/prometheus/common/version.Branch=$modv" \
        -o "$out/$c.tmp" "github.com/prometheus/prometheus/cmd/$c" >&2
      mv "$out/$c.tmp" "$out/$c"
    done
  )
}

# The prometheus-operator's CRDs (example/prometheus-operator-crd/ of its Go module), copied
# out of the module cache.
fetch_prometheus_operator_crds() {
  local out="$operator_dir/crds"
  [ -f "$out/.ready" ] && return 0
  lock_cache
  [ -f "$out/.ready" ] && return 0
  local dir
  mkdir -p "$operator_dir/mod"
  log "fetching prometheus-operator v$PROMETHEUS_OPERATOR_VERSION's CRDs from its Go module"
  dir=$(cd "$operator_dir/mod" && go mod download -json \
    "github.com/prometheus-operator/prometheus-operator@v$PROMETHEUS_OPERATOR_VERSION" |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$dir/example/prometheus-operator-crd" ] || { log "no example/prometheus-operator-crd in '$dir'"; exit 1; }
  rm -rf "$out"; mkdir -p "$out"
  cp "$dir"/example/prometheus-operator-crd/*.yaml "$out/"
  chmod u+w "$out"/*.yaml
  touch "$out/.ready"
}

# Kubernetes' pause (build/pause/linux/pause.c of the same release), compiled static with the
# machine's C compiler; scripts/build-images.sh wraps it into the pause image.
build_pause() {
  local out="$pause_dir/bin/pause"
  [ -x "$out" ] && return 0
  lock_cache
  local mod; mod=$(k8s_module)
  local src; src=$(cd "$mod" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
  [ -f "$src" ] || { log "no pause source at $src"; exit 1; }
  mkdir -p "$pause_dir/bin"
  log "building pause from $src"
  cc -Os -Wall -Werror -static -DVERSION="v$K8S_VERSION" -o "$out.tmp" "$src" >&2
  strip "$out.tmp"
  mv "$out.tmp" "$out"
}

for what in "$@"; do
  case "$what" in
    kube-apiserver|kubectl|kube-proxy|kubelet|kube-controller-manager|kube-scheduler) build_k8s "$what" ;;
    containerd) build_containerd ;;
    cni-plugins) build_cni_plugins ;;
    pause) build_pause ;;
    coredns) build_coredns ;;
    prometheus|promtool) build_prometheus ;;
    prometheus-operator-crds) fetch_prometheus_operator_crds ;;
    ipallocbench) build_ipallocbench ;;
    e2e.test) build_e2e_test ;;
    agnhost|regression-issue-74839) build_e2e_image_binary "$what" ;;
    ginkgo) build_ginkgo ;;
    etcd) build_etcd ;;
    k8s-module) k8s_module ;;
    k8s-e2e-module) k8s_e2e_module ;;
    print-dirs) echo "K8S_BIN=$k8s_dir/bin"; echo "ETCD_BIN=$etcd_dir/bin"
      echo "CONTAINERD_BIN=$containerd_dir/bin"; echo "CNI_BIN=$cni_dir/bin"; echo "PAUSE_BIN=$pause_dir/bin"
      echo "COREDNS_BIN=$coredns_dir/bin"; echo "PROMETHEUS_BIN=$prometheus_dir/bin"
      echo "PROMETHEUS_OPERATOR_CRDS=$operator_dir/crds" ;;
    *) echo "build-go-binaries: unknown binary '$what'" >&2; exit 2 ;;
  esac
done
