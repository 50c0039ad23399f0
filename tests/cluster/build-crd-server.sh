#!/usr/bin/env bash
# Build the standalone CRD API server (k8s.io/apiextensions-apiserver) from Debian sid's Go library packages,
# and cache the binary outside the repo (shared/DESIGN.md section 9). It checks CRD structural schemas and
# enforces CEL x-kubernetes-validations as a current cluster does; the tests run it beside the 1.20 control
# plane. Test infrastructure only.
#
# Sid ships whatever Kubernetes it has packaged this month, so the version is checked, not assumed: the
# sources' own binary version (k8s.io/component-base/version/base.go, DefaultKubeBinaryVersion) must agree
# with the package's (golang-k8s-apiextensions-apiserver-dev 0.X.Y is Kubernetes 1.X.Y) and be at least
# $MIN_MINOR; it is stamped into the binary (its /version answers it) and recorded beside it in
# apiextensions-apiserver.version, which tests/cluster/crdserver.py reports. A second run with the binary and
# its record present does nothing; a binary without a record (built before the check) is built again.
set -euo pipefail

CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
OUT="$CACHE_ROOT/crd-server/bin"
WORK="$CACHE_ROOT/crd-server/build"
BIN="$OUT/apiextensions-apiserver"
VERSION_FILE="$BIN.version"
GO_VERSION="1.26"
MIN_MINOR=34

step() { echo "[build-crd-server] $*"; CURRENT_STEP="$*"; }
trap 'echo "[build-crd-server] FAILED at step: ${CURRENT_STEP:-start} (see output above)" >&2' ERR

too_old() {  # $1: a version 1.X[.Y]; true when X < MIN_MINOR
  local minor; minor=$(echo "$1" | cut -d. -f2)
  [ "$(echo "$1" | cut -d. -f1)" != 1 ] || [ -z "$minor" ] || [ "$minor" -lt "$MIN_MINOR" ]
}
if [ -x "$BIN" ] && [ -s "$VERSION_FILE" ]; then
  recorded=$(cat "$VERSION_FILE")
  if too_old "$recorded"; then
    echo "[build-crd-server] FAILED: $BIN is Kubernetes $recorded, older than 1.$MIN_MINOR (remove it to rebuild)" >&2
    exit 1
  fi
  echo "[build-crd-server] reusing $BIN (Kubernetes $recorded)"; exit 0
fi
if [ -x "$BIN" ]; then echo "[build-crd-server] $BIN has no recorded version ($VERSION_FILE): building it again"; fi
start=$(date +%s)

# A private apt configuration with sid's `deb` lines and an empty package status: the machine's own sources
# and packages are never touched, and apt downloads every dependency (nothing counts as installed).
APT="$WORK/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/state"
: > "$APT/state/status"
MIRROR=$(python3 - <<'PY'
import glob, re
for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
    for uri in re.findall(r"^URIs:\s*(\S+/debian)\s*$", open(path).read(), re.M):
        print(uri); raise SystemExit
print("http://deb.debian.org/debian")
PY
)
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR sid main" > "$APT/sources.list"
APT_OPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=$APT/none"
          -o "Dir::State::Lists=$APT/lists" -o "Dir::State::status=$APT/state/status"
          -o "Dir::Cache=$APT/cache" -o "APT::Sandbox::User=root" -o "APT::Architecture=amd64"
          -o "Debug::NoLocking=1")

step "apt-get update (sid, private configuration)"
apt-get "${APT_OPTS[@]}" update -qq
step "download golang-k8s-apiextensions-apiserver-dev, its Go dependencies and go $GO_VERSION"
apt-get "${APT_OPTS[@]}" install --download-only -y -qq --no-install-recommends \
  golang-k8s-apiextensions-apiserver-dev "golang-$GO_VERSION-go" "golang-$GO_VERSION-src" >/dev/null

step "unpack the Go packages and the toolchain into one root"
ROOT="$WORK/root"
rm -rf "$ROOT"; mkdir -p "$ROOT"
for deb in "$APT/cache/archives"/*.deb; do
  case "$(basename "$deb")" in
    golang-*) dpkg-deb -x "$deb" "$ROOT" ;;
  esac
done

step "check the Kubernetes version of the sources (at least 1.$MIN_MINOR)"
SRC="$ROOT/usr/share/gocode/src/k8s.io"
DEB=$(ls "$APT/cache/archives"/golang-k8s-apiextensions-apiserver-dev_*.deb)
PACKAGE_VERSION=$(dpkg-deb -f "$DEB" Version)                         # e.g. 0.34.1-1
UPSTREAM=$(echo "$PACKAGE_VERSION" | sed -E 's/^([0-9]+:)?//; s/[-+~].*$//')
KUBE_VERSION="1.$(echo "$UPSTREAM" | cut -d. -f2-)"                      # 0.34.1 -> 1.34.1
BINARY_MINOR=$(sed -nE 's/.*DefaultKubeBinaryVersion *= *"([0-9.]+)".*/\1/p' "$SRC/component-base/version/base.go" 2>/dev/null || true)
echo "[build-crd-server] golang-k8s-apiextensions-apiserver-dev $PACKAGE_VERSION: Kubernetes $KUBE_VERSION;" \
     "component-base's DefaultKubeBinaryVersion: ${BINARY_MINOR:-absent (older than 1.31)}"
if [ "$(echo "$UPSTREAM" | cut -d. -f1)" != 0 ] || too_old "$KUBE_VERSION" || [ -z "$BINARY_MINOR" ] \
   || too_old "$BINARY_MINOR"; then
  echo "[build-crd-server] FAILED: Debian sid ships Kubernetes $KUBE_VERSION (binary version ${BINARY_MINOR:-unknown})," \
       "older than 1.$MIN_MINOR: the CEL rules of crds/ need a current API server; nothing was built" >&2
  exit 1
fi

step "go build k8s.io/apiextensions-apiserver $KUBE_VERSION (several minutes)"
mkdir -p "$OUT"
STAMP="k8s.io/component-base/version"
(
  export GOROOT="$ROOT/usr/lib/go-$GO_VERSION" GOPATH="$ROOT/usr/share/gocode" GO111MODULE=off GOPROXY=off
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOCACHE="$WORK/gocache" GOFLAGS=
  "$GOROOT/bin/go" build -o "$BIN.tmp" -ldflags "-X $STAMP.gitVersion=v$KUBE_VERSION \
    -X $STAMP.gitMajor=1 -X $STAMP.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2)" k8s.io/apiextensions-apiserver
)
# the built binary carries its version (its /version answers it; tests/test_crd_server.py asks)
grep -aqF "v$KUBE_VERSION" "$BIN.tmp" || {
  echo "[build-crd-server] FAILED: the built binary does not carry version v$KUBE_VERSION" >&2; exit 1; }
mv "$BIN.tmp" "$BIN"
echo "$KUBE_VERSION" > "$VERSION_FILE"
rm -rf "$ROOT" "$APT/cache/archives"/*.deb
echo "[build-crd-server] built $BIN (Kubernetes $KUBE_VERSION, recorded in $VERSION_FILE) in $(( $(date +%s) - start )) s"
