#!/usr/bin/env bash
# Builds the container images of clusterip from the repository's Containerfiles, on a machine
# that reaches no container registry: the base images the Containerfiles name are made here
# from Debian's packages first, under the very names the Containerfiles use, so the
# Containerfiles are built unchanged (and build the same way elsewhere against real registries).
#
#   scripts/build-images.sh [clusterip] [clusterip-agent] [pause] [node-test]
#                           [e2e-agnhost] [e2e-busybox] [e2e-pause]
#                           [e2e-regression-issue-74839] [coredns] [kube-proxy]
#                                   (default: the first three; node-test: scripts/test-node.sh's
#                                   workload, tests/node/Containerfile; e2e-*: the images
#                                   Kubernetes' e2e suite runs, scripts/lib/build-e2e-images.sh)
#
# What it makes (in buildah's storage under ${CLUSTERIP_CACHE:-~/.cache/clusterip}/buildah):
#   docker.io/library/debian:bookworm-slim   mmdebstrap --variant=minbase of bookworm, with
#                                            bookworm, -updates and -security in its sources
#   docker.io/library/rust:<X.Y>-bookworm    the same plus build-essential and pkg-config, and
#                                            this machine's Rust toolchain (rustc --version:
#                                            X.Y) in /usr/local/rustup like the official image
#   docker.io/library/clusterip:dev          Containerfile
#   docker.io/library/clusterip-agent:dev    agent/Containerfile
#   registry.k8s.io/pause:<K8S_VERSION>      Kubernetes' pause, built from its source
#                                            (scripts/lib/build-go-binaries.sh pause)
#   registry.k8s.io/kube-proxy:v<K8S_VERSION>  kube-proxy (build-go-binaries.sh kube-proxy) in
#                                            /usr/local/bin on Debian minbase with nftables,
#                                            iptables and conntrack (tests/node/kube-proxy.yaml)
# and an OCI archive of each of the last four in target/images/<name>.oci.tar, which
# scripts/node-cluster.sh imports into the node's containerd. The e2e suite's images, under
# the names Kubernetes' e2e.test v<K8S_VERSION> pulls (archives in target/images/e2e/):
#   registry.k8s.io/e2e-test-images/agnhost:<VERSION>   test/images/agnhost of the Kubernetes
#                                            module (binary: build-go-binaries.sh agnhost) on
#                                            Debian minbase with the tools its Dockerfile adds
#   registry.k8s.io/e2e-test-images/busybox:<E2E_BUSYBOX_TAG>  Debian's busybox-static alone
#   registry.k8s.io/pause:<E2E_PAUSE_TAG>    the pause image above under the e2e suite's name
#   registry.k8s.io/coredns/coredns:v<COREDNS_VERSION>  the cluster DNS the suite expects
#                                            (build-go-binaries.sh coredns), as CoreDNS's own
#                                            Dockerfile makes it (target/images/e2e/coredns.oci.tar)
#
# Base images are made once (delete them with `buildah --root … rmi` to refresh). The Rust
# builds keep their registry and target directories in buildah cache mounts, so a rebuild
# after a source change compiles only what changed. Needs root (buildah, mmdebstrap); installs
# buildah, mmdebstrap and uidmap when missing. CLUSTERIP_IMAGE_TAG changes the tag (dev).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=versions.env
. "$repo/scripts/versions.env"

cache_root=${CLUSTERIP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/clusterip}
bstore=$cache_root/buildah
out=$repo/target/images
tag=${CLUSTERIP_IMAGE_TAG:-dev}
suite=bookworm
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security
debian_image=docker.io/library/debian:$suite-slim
rust_version=$(rustc --version | awk '{print $2}')
rust_image=docker.io/library/rust:${rust_version%.*}-$suite
pause_image=registry.k8s.io/pause:$K8S_VERSION

log() { echo "build-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (buildah with its own storage, mmdebstrap)"
"$repo/scripts/lib/ensure-packages.sh" buildah mmdebstrap uidmap

# buildah with storage of its own (never the machine's /var/lib/containers), its temporary
# files and cache mounts under it too (buildah puts them in TMPDIR).
mkdir -p "$bstore/tmp" "$out/e2e"
export TMPDIR=$bstore/tmp
bh() { buildah --root "$bstore/storage" --runroot "$bstore/run" --storage-driver overlay "$@"; }
have_image() { bh inspect --type image "$1" >/dev/null 2>&1; }

# One build at a time on this storage. On exit nothing of it stays: no working container
# (a failed step leaves one), no untagged image (the build stages: ~1.2 GiB each), and no
# mount in the machine's mount namespace (containers/storage bind-mounts its overlay dir).
exec 9>"$bstore/.lock"
flock -n 9 || { log "another build-images.sh holds $bstore/.lock; waiting"; flock 9; }
cleanup() {
  bh rm --all >/dev/null 2>&1 || true
  bh rmi --prune >/dev/null 2>&1 || true
  umount "$bstore/storage/overlay" 2>/dev/null || true
}
trap cleanup EXIT

# A root filesystem from Debian's packages (mmdebstrap), imported as image $1; $2… are extra
# packages. The config matches the official images: bash, PATH, nothing else.
debian_rootfs_image() {
  local name=$1; shift
  local include="ca-certificates${1:+,$(IFS=,; echo "$*")}" tar ctr
  tar=$(mktemp "$bstore/tmp/rootfs.XXXXXX.tar")
  log "making $name from Debian $suite packages (mmdebstrap; once)"
  mmdebstrap --quiet --variant=minbase --include="$include" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --aptopt='APT::Install-Recommends "false"' \
    "$suite" "$tar" \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main"
  ctr=$(bh from scratch)
  bh add "$ctr" "$tar" / >/dev/null
  rm -f "$tar"
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash --os linux --arch amd64 "$ctr"
  echo "$ctr"
}

make_debian_image() {
  have_image "$debian_image" && return 0
  local ctr; ctr=$(debian_rootfs_image "$debian_image")
  bh commit --quiet --rm "$ctr" "$debian_image" >/dev/null
}

# The official rust:X.Y-bookworm image keeps rustup's toolchain in /usr/local/rustup and
# cargo's home in /usr/local/cargo (PATH starts with /usr/local/cargo/bin); this one holds
# the same rustc/cargo release, copied from this machine (no rustup: one fixed toolchain).
make_rust_image() {
  have_image "$rust_image" && return 0
  local sysroot ctr mnt tc
  sysroot=$(rustc --print sysroot)
  ctr=$(debian_rootfs_image "$rust_image" build-essential pkg-config git)
  mnt=$(bh mount "$ctr")
  tc=/usr/local/rustup/toolchains/$rust_version-x86_64-unknown-linux-gnu
  mkdir -p "$mnt$tc" "$mnt/usr/local/cargo/bin"
  log "copying the Rust $rust_version toolchain ($sysroot: bin, lib) into $rust_image"
  cp -a "$sysroot/bin" "$sysroot/lib" "$mnt$tc/"
  for b in "$mnt$tc"/bin/*; do ln -s "$tc/bin/${b##*/}" "$mnt/usr/local/cargo/bin/${b##*/}"; done
  # The machine's trusted CAs, so cargo reaches crates.io inside as it does outside (behind a
  # TLS-inspecting proxy too); the official image trusts Debian's CA list only.
  cp /etc/ssl/certs/ca-certificates.crt "$mnt/etc/ssl/certs/ca-certificates.crt"
  bh umount "$ctr" >/dev/null
  bh config --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env RUST_VERSION="$rust_version" "$ctr"
  bh commit --quiet --rm "$ctr" "$rust_image" >/dev/null
}

# The commit the binaries report (--version, *_build_info): the Containerfiles' build context
# holds no .git (build.rs reads CLUSTERIP_COMMIT instead).
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)

# Build a Containerfile unchanged (its defaults name the images made above; the Rust image's
# tag follows this machine's rustc). Host network: apt and cargo inside reach Debian's
# mirrors and crates.io as this machine does, without a container network to set up.
build_containerfile() {
  local image=$1 file=$2 context=${3:-$repo} started=$SECONDS
  log "building $image from $file"
  bh build --quiet --layers --pull=never --network host --isolation chroot \
    --build-arg RUST_IMAGE="$rust_image" --build-arg BASE_IMAGE="$debian_image" \
    --build-arg CLUSTERIP_COMMIT="$commit" \
    -f "$repo/$file" -t "$image" "$context" >/dev/null
  log "built $image in $((SECONDS - started))s"
}

# pause: Kubernetes' build/pause/Dockerfile is FROM scratch + the static binary, USER 65535.
build_pause() {
  local bin ctr
  "$repo/scripts/lib/build-go-binaries.sh" pause
  eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
  bin=$PAUSE_BIN/pause
  ctr=$(bh from scratch)
  bh copy "$ctr" "$bin" /pause >/dev/null
  bh config --user 65535:65535 --entrypoint '["/pause"]' --os linux --arch amd64 "$ctr"
  bh commit --quiet --rm "$ctr" "$pause_image" >/dev/null
  log "built $pause_image"
}

# agnhost as test/images/agnhost/Dockerfile makes it, on Debian instead of Alpine: the tools
# its tests exec (dig, curl, nc, ss/ip, iperf, bash, ipcs, socat), porter's certificate,
# /uploads, the agnhost-2 link and the user/group defined in the image. Left out: CoreDNS
# (DNS tests run it from this image) and the fake registry's content (/var/registry, image
# pull tests); tests needing those are not run here (docs/conformance.md).
build_e2e_agnhost() {
  local mod src version bin ctr mnt
  "$repo/scripts/lib/build-go-binaries.sh" agnhost
  eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
  bin=$K8S_BIN/agnhost
  mod=$("$repo/scripts/lib/build-go-binaries.sh" k8s-e2e-module)
  src=$(cd "$mod" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/agnhost
  version=$(cat "$src/VERSION")
  e2e_agnhost_image=registry.k8s.io/e2e-test-images/agnhost:$version
  # (Built again when agnhost or this recipe is newer than the archive.)
  have_image "$e2e_agnhost_image" && [ ! "$bin" -nt "$out/e2e/agnhost.oci.tar" ] &&
    [ ! "${BASH_SOURCE[0]}" -nt "$out/e2e/agnhost.oci.tar" ] && return 0
  ctr=$(debian_rootfs_image "$e2e_agnhost_image" bind9-dnsutils curl netcat-openbsd iproute2 \
    iperf bash util-linux socat passwd busybox wget)
  mnt=$(bh mount "$ctr")
  # Upstream's image is Alpine, whose base is busybox: every command no package provides is
  # a busybox applet (tests run `wget -q -O - -T 1 …`, `ping`, … in agnhost pods). Here too:
  # an applet link, in /usr/local/bin, for each command the Debian packages above lack.
  chroot "$mnt" /bin/busybox --list | while IFS= read -r applet; do
    [ -n "$applet" ] || continue
    chroot "$mnt" sh -c 'command -v "$1"' _ "$applet" >/dev/null 2>&1 && continue
    ln -s /bin/busybox "$mnt/usr/local/bin/$applet"
  done
  # wget is GNU wget, not the applet: bookworm's busybox 1.35 (static or not) crashes on
  # `wget -T N`, which the suite runs. The check below keeps a crashing wget out.
  local rc=0
  chroot "$mnt" wget -q -O - -T 1 http://127.0.0.1:9/ >/dev/null 2>&1 || rc=$?
  [ "$rc" -lt 128 ] || die "the agnhost image's wget crashes (exit $rc)"
  install -m 0755 "$bin" "$mnt/agnhost"
  ln -s agnhost "$mnt/agnhost-2"
  install -m 0644 "$src/porter/localhost.crt" "$src/porter/localhost.key" "$mnt/"
  mkdir -p "$mnt/uploads"
  ln -sf /usr/bin/iperf "$mnt/usr/local/bin/iperf"
  chroot "$mnt" sh -ec 'groupadd -g 50000 group-defined-in-image
    useradd -u 1000 -U -m -G group-defined-in-image user-defined-in-image'
  bh umount "$ctr" >/dev/null
  bh config --entrypoint '["/agnhost"]' --cmd pause --workingdir / \
    --port 80 --port 8080 --port 8081 --port 9376 --port 5000 "$ctr"
  bh commit --quiet --rm "$ctr" "$e2e_agnhost_image" >/dev/null
  log "built $e2e_agnhost_image"
}

# regression-issue-74839: the conntrack test's prober (test/images/regression-issue-74839 of
# the same module: a raw TCP socket that answers an out-of-window packet). Upstream's base is
# Kubernetes' debian-base (bookworm); here bookworm minbase, the binary as its entrypoint.
build_e2e_regression_issue_74839() {
  local mod src bin ctr mnt
  "$repo/scripts/lib/build-go-binaries.sh" regression-issue-74839
  eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
  bin=$K8S_BIN/regression-issue-74839
  mod=$("$repo/scripts/lib/build-go-binaries.sh" k8s-e2e-module)
  src=$(cd "$mod" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/regression-issue-74839
  e2e_regression_image=registry.k8s.io/e2e-test-images/regression-issue-74839:$(cat "$src/VERSION")
  have_image "$e2e_regression_image" && [ ! "$bin" -nt "$out/e2e/regression-issue-74839.oci.tar" ] && return 0
  ctr=$(debian_rootfs_image "$e2e_regression_image")
  mnt=$(bh mount "$ctr")
  install -m 0755 "$bin" "$mnt/regression-issue-74839"
  bh umount "$ctr" >/dev/null
  bh config --entrypoint '["/regression-issue-74839"]' --cmd '' "$ctr"
  bh commit --quiet --rm "$ctr" "$e2e_regression_image" >/dev/null
  log "built $e2e_regression_image"
}

# busybox: the e2e suite's busybox image is Docker's busybox (one static binary, a link per
# applet in /bin, a minimal /etc). Debian's busybox-static in an image of its own is the
# nearest thing made from Debian packages: the same program, Debian's release of it and
# Debian's applet set, tagged with the name the suite pulls.
build_e2e_busybox() {
  local tag=$1 dir ctr deb
  e2e_busybox_image=registry.k8s.io/e2e-test-images/busybox:$tag
  have_image "$e2e_busybox_image" && return 0
  dir=$(mktemp -d "$bstore/tmp/busybox.XXXXXX")
  chown _apt "$dir" 2>/dev/null || true   # (apt-get download fetches as _apt)
  ( cd "$dir" && apt-get download -q busybox-static >&2 )
  deb=$(ls "$dir"/busybox-static_*.deb)
  dpkg-deb -x "$deb" "$dir/pkg"
  mkdir -p "$dir/root/bin" "$dir/root/etc" "$dir/root/tmp" "$dir/root/root" "$dir/root/home"
  chmod 1777 "$dir/root/tmp"
  install -m 0755 "$dir/pkg/bin/busybox" "$dir/root/bin/busybox"
  local a
  for a in $("$dir/root/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -s busybox "$dir/root/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\ndaemon:x:1:1:daemon:/usr/sbin:/bin/false\nnobody:x:65534:65534:nobody:/home:/bin/false\n' > "$dir/root/etc/passwd"
  printf 'root:x:0:\ndaemon:x:1:\nnogroup:x:65534:\n' > "$dir/root/etc/group"
  ctr=$(bh from scratch)
  bh copy "$ctr" "$dir/root/" / >/dev/null
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd sh --os linux --arch amd64 "$ctr"
  bh commit --quiet --rm "$ctr" "$e2e_busybox_image" >/dev/null
  rm -rf "$dir"
  log "built $e2e_busybox_image (Debian's busybox-static $(dpkg-deb -f "$deb" Version))"
}

# CoreDNS as its Dockerfile makes it: the binary, the CA certificates, user nonroot (65532)
# — distroless/static-debian12:nonroot there, the same few files from Debian here.
build_coredns() {
  local bin dir ctr mnt
  "$repo/scripts/lib/build-go-binaries.sh" coredns
  eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
  bin=$COREDNS_BIN/coredns
  coredns_image=registry.k8s.io/coredns/coredns:v$COREDNS_VERSION
  have_image "$coredns_image" && [ ! "$bin" -nt "$out/e2e/coredns.oci.tar" ] && return 0
  make_debian_image
  dir=$(mktemp -d "$bstore/tmp/coredns.XXXXXX")
  mkdir -p "$dir/root/etc/ssl" "$dir/root/tmp" "$dir/root/home/nonroot"
  chmod 1777 "$dir/root/tmp"
  ctr=$(bh from --pull=never "$debian_image")
  mnt=$(bh mount "$ctr")
  cp -a "$mnt/etc/ssl/certs" "$dir/root/etc/ssl/"
  bh umount "$ctr" >/dev/null; bh rm "$ctr" >/dev/null
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$dir/root/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' > "$dir/root/etc/group"
  install -m 0755 "$bin" "$dir/root/coredns"
  ctr=$(bh from scratch)
  bh copy "$ctr" "$dir/root/" / >/dev/null
  bh config --user 65532:65532 --workingdir / --port 53 --port 53/udp \
    --entrypoint '["/coredns"]' --os linux --arch amd64 "$ctr"
  bh commit --quiet --rm "$ctr" "$coredns_image" >/dev/null
  rm -rf "$dir"
  log "built $coredns_image"
}

# kube-proxy as the release's image has it (build/server-image/kube-proxy: the binary in
# /usr/local/bin on distroless-iptables, which carries iptables, nft and conntrack), on
# Debian minbase with Debian's nftables, iptables and conntrack instead. No entrypoint: the
# DaemonSet names the command, as kubeadm's does.
build_kube_proxy() {
  local bin ctr mnt
  "$repo/scripts/lib/build-go-binaries.sh" kube-proxy
  eval "$("$repo/scripts/lib/build-go-binaries.sh" print-dirs)"
  bin=$K8S_BIN/kube-proxy
  kube_proxy_image=registry.k8s.io/kube-proxy:v$K8S_VERSION
  have_image "$kube_proxy_image" && [ ! "$bin" -nt "$out/kube-proxy.oci.tar" ] && return 0
  ctr=$(debian_rootfs_image "$kube_proxy_image" nftables iptables conntrack)
  mnt=$(bh mount "$ctr")
  install -m 0755 "$bin" "$mnt/usr/local/bin/kube-proxy"
  bh umount "$ctr" >/dev/null
  bh config --cmd /usr/local/bin/kube-proxy "$ctr"
  bh commit --quiet --rm "$ctr" "$kube_proxy_image" >/dev/null
  log "built $kube_proxy_image"
}

export_archive() {
  local image=$1 file=$2
  rm -f "$out/$file.tmp"
  bh push --quiet "$image" "oci-archive:$out/$file.tmp:$image" >/dev/null
  mv "$out/$file.tmp" "$out/$file"
  log "wrote $out/$file"
}

what=("$@")
[ ${#what[@]} -gt 0 ] || what=(clusterip clusterip-agent pause)
for w in "${what[@]}"; do
  case "$w" in
    clusterip)
      make_debian_image; make_rust_image
      build_containerfile "docker.io/library/clusterip:$tag" Containerfile
      export_archive "docker.io/library/clusterip:$tag" clusterip.oci.tar ;;
    clusterip-agent)
      make_debian_image; make_rust_image
      build_containerfile "docker.io/library/clusterip-agent:$tag" agent/Containerfile
      export_archive "docker.io/library/clusterip-agent:$tag" clusterip-agent.oci.tar ;;
    node-test)
      make_debian_image
      build_containerfile "docker.io/library/clusterip-node-test:$tag" tests/node/Containerfile "$repo/tests/node"
      export_archive "docker.io/library/clusterip-node-test:$tag" node-test.oci.tar ;;
    pause)
      build_pause
      export_archive "$pause_image" pause.oci.tar ;;
    e2e-agnhost)
      build_e2e_agnhost
      export_archive "$e2e_agnhost_image" e2e/agnhost.oci.tar ;;
    e2e-busybox)
      build_e2e_busybox "${E2E_BUSYBOX_TAG:?the tag e2e.test pulls}"
      export_archive "$e2e_busybox_image" e2e/busybox.oci.tar ;;
    e2e-pause)
      have_image "$pause_image" || build_pause
      e2e_pause_image=registry.k8s.io/pause:${E2E_PAUSE_TAG:?the tag e2e.test pulls}
      bh tag "$pause_image" "$e2e_pause_image"
      export_archive "$e2e_pause_image" e2e/pause.oci.tar ;;
    e2e-regression-issue-74839)
      build_e2e_regression_issue_74839
      export_archive "$e2e_regression_image" e2e/regression-issue-74839.oci.tar ;;
    coredns)
      build_coredns
      export_archive "$coredns_image" e2e/coredns.oci.tar ;;
    kube-proxy)
      build_kube_proxy
      export_archive "$kube_proxy_image" kube-proxy.oci.tar ;;
    *) die "unknown image '$w' (clusterip, clusterip-agent, pause, node-test, e2e-agnhost, e2e-busybox, e2e-pause, e2e-regression-issue-74839, coredns, kube-proxy)" ;;
  esac
done
