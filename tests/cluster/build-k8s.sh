#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler and kubectl 1.20.2 from Debian bookworm's
# source package, and cache the binaries outside the repo, keyed by version (shared/DESIGN.md section 4).
# Test infrastructure only. A second run with the binaries present does nothing.
set -euo pipefail

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
K8S_VERSION="1.20.2"
CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
OUT="$CACHE_ROOT/k8s-$K8S_VERSION/bin"
WORK="$CACHE_ROOT/k8s-$K8S_VERSION/build"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

step() { echo "[build-k8s] $*"; CURRENT_STEP="$*"; }
trap 'echo "[build-k8s] FAILED at step: ${CURRENT_STEP:-start} (see output above)" >&2' ERR

have_all() { for c in "${COMPONENTS[@]}"; do [ -x "$OUT/$c" ] || return 1; done; }
if have_all && command -v etcd >/dev/null; then echo "[build-k8s] reusing binaries in $OUT"; exit 0; fi

start=$(date +%s)
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_pkgs=()
for p in golang-go rsync dpkg-dev make etcd-server openssl \
         golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  step "apt-get install ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

# A private apt configuration holding only a deb-src line: the machine's sources are never edited.
APT="$WORK/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$WORK/src"
# deb-src lines for the machine's own mirrors and suites (its deb822 or one-line sources), so nothing
# here names a host; the machine's own sources are only read.
python3 - "$APT/sources.list" <<'PY'
import glob, re, sys
entries = set()
for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
    for block in re.split(r"\n\s*\n", open(path).read()):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", block, re.M))
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            for uri in fields.get("URIs", "").split():
                for suite in fields.get("Suites", "").split():
                    entries.add((uri, suite))
for path in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
    try:
        text = open(path).read()
    except OSError:
        continue
    for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
        entries.add((m.group(1), m.group(2)))
entries = sorted(e for e in entries if e[1].startswith("bookworm"))
if not entries:
    sys.exit("[build-k8s] FAILED: no bookworm entry in the machine's apt sources")
with open(sys.argv[1], "w") as out:
    for uri, suite in entries:
        out.write(f"deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {uri} {suite} main\n")
PY
APT_OPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=$APT/none"
          -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "APT::Sandbox::User=root")

SRC_DIR="$WORK/src/kubernetes-$K8S_VERSION"
if [ ! -d "$SRC_DIR" ]; then
  if have_all; then echo "[build-k8s] reusing binaries in $OUT"; exit 0; fi

  step "download Debian source package kubernetes=$K8S_DEB_VERSION"
  apt-get "${APT_OPTS[@]}" update -qq
  (cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only -qq "kubernetes=$K8S_DEB_VERSION")
  step "unpack source package"
  dsc=$(ls "$WORK/src"/kubernetes_*.dsc | head -n1)
  rm -rf "$SRC_DIR.tmp"
  dpkg-source --no-check -x "$dsc" "$SRC_DIR.tmp" >/dev/null
  mv "$SRC_DIR.tmp" "$SRC_DIR"
fi

step "replace vendored reflect2 and json-iterator with Debian's newer sources"
for pair in "github.com/modern-go/reflect2" "github.com/json-iterator/go"; do
  rm -rf "${SRC_DIR:?}/vendor/$pair"
  mkdir -p "$SRC_DIR/vendor/$pair"
  cp -r "/usr/share/gocode/src/$pair/." "$SRC_DIR/vendor/$pair/"
  find "$SRC_DIR/vendor/$pair" \( -name '*_test.go' -o -name 'go.mod' -o -name 'go.sum' \) -delete
done

step "go build ${COMPONENTS[*]} (several minutes on 2 cores)"
GOPATH_DIR="$WORK/gopath"
mkdir -p "$GOPATH_DIR/src/k8s.io"
ln -sfn "$SRC_DIR" "$GOPATH_DIR/src/k8s.io/kubernetes"
whats=""; for c in "${COMPONENTS[@]}"; do whats+="cmd/$c "; done
(
  cd "$GOPATH_DIR/src/k8s.io/kubernetes"
  export GOPATH="$GOPATH_DIR" GO111MODULE=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOCACHE="$WORK/gocache"
  export KUBE_GIT_VERSION="v$K8S_VERSION" KUBE_GIT_TREE_STATE=clean KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
  unset GOFLAGS
  make WHAT="${whats% }" KUBE_BUILD_PLATFORMS=linux/amd64
)

step "install binaries into $OUT"
mkdir -p "$OUT"
for c in "${COMPONENTS[@]}"; do
  bin=$(find "$SRC_DIR/_output" -type f -name "$c" -perm -u+x | head -n1)
  [ -n "$bin" ] || { echo "[build-k8s] FAILED: $c was not produced" >&2; exit 1; }
  install -m 0755 "$bin" "$OUT/$c"
done
echo "[build-k8s] built ${COMPONENTS[*]} in $(( $(date +%s) - start )) s -> $OUT"
