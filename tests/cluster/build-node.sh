#!/usr/bin/env bash
# A real node for tests (issue 34): Debian's container packages, the kubelet 1.20.2 built from the Kubernetes
# source tree tests/cluster/build-k8s.sh unpacks (run that first), and the pause image's static binary.
# Everything is cached beside the control plane's binaries; a second run with them present does nothing.
# Test infrastructure only.
set -euo pipefail
{ # the whole script is read before it runs: editing it meanwhile cannot change a running build

K8S_VERSION="1.20.2"
CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
OUT="$CACHE_ROOT/k8s-$K8S_VERSION/bin"
WORK="$CACHE_ROOT/k8s-$K8S_VERSION/build"
SRC_DIR="$WORK/src/kubernetes-$K8S_VERSION"
PAUSE_OUT="$CACHE_ROOT/pause"
# runc runs the containers (crun refuses the hybrid cgroup layout); containerd runs pods for the kubelet;
# podman/buildah build the images; docker-registry serves them on 127.0.0.1; iptables is only read (the
# fixture checks it left no rule behind).
PACKAGES=(runc containerd podman buildah skopeo mmdebstrap docker-registry containernetworking-plugins
          iptables gcc libc6-dev golang-go rsync make)

step() { echo "[build-node] $*"; CURRENT_STEP="$*"; }
trap 'echo "[build-node] FAILED at step: ${CURRENT_STEP:-start} (see output above)" >&2' ERR
start=$(date +%s)

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_pkgs=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  step "apt-get install ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  # --no-install-recommends: podman's recommends would pull in a network stack and services of its own
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
# (Debian's containerd package may start a service of its own where systemd runs; the tests never use it:
# their containerd has its own socket, root, state and configuration under the test's folder.)

if [ ! -x "$PAUSE_OUT/pause" ]; then
  # the pod sandbox's process: Kubernetes' own pause.c from the same tree, linked statically
  pause_c="$SRC_DIR/build/pause/linux/pause.c"
  [ -f "$pause_c" ] || pause_c="$SRC_DIR/build/pause/pause.c"
  [ -f "$pause_c" ] || { echo "[build-node] FAILED: no pause.c in $SRC_DIR/build/pause" >&2; exit 1; }
  step "gcc -static $pause_c"
  mkdir -p "$PAUSE_OUT"
  gcc -Os -Wall -Werror -static -DVERSION="v3.4.1-spyre" -o "$PAUSE_OUT/pause.tmp" "$pause_c"
  strip "$PAUSE_OUT/pause.tmp"
  mv "$PAUSE_OUT/pause.tmp" "$PAUSE_OUT/pause"
fi
if [ ! -x "$OUT/kubelet" ]; then
  [ -d "$SRC_DIR" ] || { echo "[build-node] FAILED: no Kubernetes source tree at $SRC_DIR;" \
    "run tests/cluster/build-k8s.sh first (it unpacks it; delete $OUT to make it unpack again)" >&2; exit 1; }
  step "go build cmd/kubelet from $SRC_DIR (several minutes on 2 cores, once)"
  t0=$(date +%s)
  GOPATH_DIR="$WORK/gopath"
  mkdir -p "$GOPATH_DIR/src/k8s.io"
  ln -sfn "$SRC_DIR" "$GOPATH_DIR/src/k8s.io/kubernetes"
  (
    cd "$GOPATH_DIR/src/k8s.io/kubernetes"
    export GOPATH="$GOPATH_DIR" GO111MODULE=off CGO_ENABLED=0 GOCACHE="$WORK/gocache"
    export KUBE_GIT_VERSION="v$K8S_VERSION" KUBE_GIT_TREE_STATE=clean KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
    nice -n 10 make WHAT=cmd/kubelet KUBE_BUILD_PLATFORMS=linux/amd64
  )
  bin=$(find "$SRC_DIR/_output" -type f -name kubelet -perm -u+x | head -n1)
  [ -n "$bin" ] || { echo "[build-node] FAILED: kubelet was not produced" >&2; exit 1; }
  mkdir -p "$OUT"
  install -m 0755 "$bin" "$OUT/kubelet"
  echo "[build-node] built kubelet in $(( $(date +%s) - t0 )) s -> $OUT/kubelet"
fi

echo "[build-node] node ready in $(( $(date +%s) - start )) s: $OUT/kubelet, $PAUSE_OUT/pause"
exit
}
