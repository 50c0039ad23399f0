#!/usr/bin/env bash
# Build the standalone CRD API server of Kubernetes 1.36 (k8s.io/apiextensions-apiserver) from Debian sid's
# Go library packages, and cache the binary outside the repo (shared/DESIGN.md section 9). It checks CRD
# structural schemas and enforces CEL x-kubernetes-validations as a current cluster does; the tests run it
# beside the 1.20 control plane. Test infrastructure only. A second run with the binary present does nothing.
set -euo pipefail

CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
OUT="$CACHE_ROOT/crd-server/bin"
WORK="$CACHE_ROOT/crd-server/build"
BIN="$OUT/apiextensions-apiserver"
GO_VERSION="1.26"

step() { echo "[build-crd-server] $*"; CURRENT_STEP="$*"; }
trap 'echo "[build-crd-server] FAILED at step: ${CURRENT_STEP:-start} (see output above)" >&2' ERR

if [ -x "$BIN" ]; then echo "[build-crd-server] reusing $BIN"; exit 0; fi
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

step "go build k8s.io/apiextensions-apiserver (several minutes)"
mkdir -p "$OUT"
(
  export GOROOT="$ROOT/usr/lib/go-$GO_VERSION" GOPATH="$ROOT/usr/share/gocode" GO111MODULE=off GOPROXY=off
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOCACHE="$WORK/gocache" GOFLAGS=
  "$GOROOT/bin/go" build -o "$BIN.tmp" k8s.io/apiextensions-apiserver
)
mv "$BIN.tmp" "$BIN"
rm -rf "$ROOT" "$APT/cache/archives"/*.deb
echo "[build-crd-server] built $BIN in $(( $(date +%s) - start )) s"
