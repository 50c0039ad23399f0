#!/usr/bin/env bash
# The images the real node runs (issue 34), built by podman from the project's own files and pushed to a
# local registry whose storage is cached (~/.cache/spyre-serve/registry):
#   - a Debian base laid out like the UBI python image the Containerfiles default to (no base image can be
#     pulled here): mmdebstrap minbase + python3, pip, venv, the host's CA certificates, and the C++ compiler
#     and Python headers UBI's python image carries (inductor compiles its kernels with them); a venv in
#     /opt/app-root first on PATH, user 1001 in group 0. Cached in podman's storage.
#   - the pause image (the static binary build-node.sh made), the runtime image from Containerfile.runtime
#     (torch from the machine's local CPU wheel), the operator image from Containerfile, and a modelcar of
#     the seeded tiny model (`spyre-runtime tiny-model` in /models of the base image).
# Project images are tagged by their content (tests/cluster/images.py): a second run with the same tree does
# nothing. Needs tests/cluster/build-node.sh first. Test infrastructure only.
set -euo pipefail
{ # the whole script is read before it runs: editing it meanwhile cannot change a running build

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
export SPYRE_K8S_CACHE="$CACHE_ROOT"
PY="${PYTHON:-python3}"
IMAGES=(pause runtime operator tiny-model)

step() { echo "[build-images] $*"; CURRENT_STEP="$*"; }
trap 'echo "[build-images] FAILED at step: ${CURRENT_STEP:-start} (see output above)" >&2' ERR
start=$(date +%s)

ref() { "$PY" "$REPO/tests/cluster/images.py" ref "$1"; }
cached() { "$PY" "$REPO/tests/cluster/images.py" cached "$1"; }
missing=()
for kind in "${IMAGES[@]}"; do cached "$kind" || missing+=("$kind"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[build-images] reusing $(for k in "${IMAGES[@]}"; do printf '%s ' "$(ref "$k")"; done)from $CACHE_ROOT/registry"
  exit 0
fi
for tool in podman mmdebstrap docker-registry; do
  command -v "$tool" >/dev/null || { echo "[build-images] FAILED: $tool is missing; run tests/cluster/build-node.sh" >&2; exit 1; }
done

# podman with a storage and configuration of its own (the machine's are never used): overlay storage, the
# cgroupfs manager, a file events logger, runc, and ulimits no higher than this process has (the VM lacks
# CAP_SYS_RESOURCE, so a container cannot be given more).
PODMAN_DIR="$CACHE_ROOT/podman"
mkdir -p "$PODMAN_DIR/storage"
cat >"$PODMAN_DIR/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$PODMAN_DIR/storage"
runroot = "/run/spyre-serve-podman"
EOF
cat >"$PODMAN_DIR/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Sn):$(ulimit -Hn)"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$PODMAN_DIR/events.log"
runtime = "runc"
EOF
export CONTAINERS_STORAGE_CONF="$PODMAN_DIR/storage.conf" CONTAINERS_CONF="$PODMAN_DIR/containers.conf"

BASE_REF="localhost/$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import images; print(images.BASE_REF)' "$REPO/tests/cluster")"
if ! podman image exists "$BASE_REF"; then
  step "base image $BASE_REF: mmdebstrap minbase + python3, pip, venv, g++, python3-dev, CA certificates (about 3 min)"
  t0=$(date +%s)
  BASE_WORK="$CACHE_ROOT/base-build"
  rm -rf "$BASE_WORK"; mkdir -p "$BASE_WORK/ca"
  # the CA certificates the host trusts, one file each (package downloads in a build go through the same
  # TLS-intercepting proxy as the host's)
  "$PY" - /etc/ssl/certs/ca-certificates.crt "$BASE_WORK/ca" <<'PY'
import re, sys
pems = re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", open(sys.argv[1]).read(), re.S)
for i, pem in enumerate(pems):
    open(f"{sys.argv[2]}/host-{i:03d}.crt", "w").write(pem + "\n")
PY
  sources=$(ls /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 || true)
  [ -n "$sources" ] || sources=/etc/apt/sources.list
  nice -n 10 mmdebstrap --variant=minbase --include=python3,python3-pip,python3-venv,python3-dev,g++,ca-certificates \
    --customize-hook="mkdir -p \"\$1/usr/local/share/ca-certificates/host\" && cp $BASE_WORK/ca/*.crt \"\$1/usr/local/share/ca-certificates/host/\" && chroot \"\$1\" update-ca-certificates >/dev/null" \
    --customize-hook='chroot "$1" useradd --uid 1001 --gid 0 --home-dir /opt/app-root/src --no-create-home default' \
    --customize-hook='chroot "$1" python3 -m venv /opt/app-root && mkdir -p "$1/opt/app-root/src" && chroot "$1" chown -R 1001:0 /opt/app-root && chmod -R g=u "$1/opt/app-root"' \
    --customize-hook='rm -rf "$1/var/cache/apt/archives/"*.deb "$1/var/lib/apt/lists/"*' \
    bookworm "$BASE_WORK/rootfs.tar" "$sources"
  podman import \
    --change 'ENV PATH=/opt/app-root/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV VIRTUAL_ENV=/opt/app-root HOME=/opt/app-root/src PYTHONUNBUFFERED=1' \
    --change 'WORKDIR /opt/app-root/src' --change 'USER 1001' --change 'CMD ["/bin/bash"]' \
    "$BASE_WORK/rootfs.tar" "$BASE_REF" >/dev/null
  rm -rf "$BASE_WORK"
  echo "[build-images] base image in $(( $(date +%s) - t0 )) s"
fi

# torch comes from the machine's own CPU wheel (PyPI's torch is the CUDA build): pip finds it through the
# machine's pip configuration; the build sees it through a read-only volume and a pip.conf naming it.
WHEELS="$CACHE_ROOT/wheels"
if ! ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  step "locate the local torch==2.13.0 CPU wheel"
  mkdir -p "$WHEELS"
  "${HOST_PIP_PYTHON:-$REPO/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
    -d "$WHEELS" "torch==2.13.0"
  ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 || { echo "[build-images] FAILED: pip found no" \
    "torch 2.13.0+cpu wheel on this machine (got: $(ls "$WHEELS"))" >&2; exit 1; }
fi
printf '[global]\nfind-links = /wheels\n' >"$WHEELS/pip.conf"

REG_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$CACHE_ROOT/registry"
cat >"$PODMAN_DIR/registry.yml" <<EOF
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: "$CACHE_ROOT/registry"}, delete: {enabled: true}}
http: {addr: "127.0.0.1:$REG_PORT"}
EOF
step "start the local registry on 127.0.0.1:$REG_PORT"
docker-registry serve "$PODMAN_DIR/registry.yml" >"$PODMAN_DIR/registry.log" 2>&1 &
REG_PID=$!
trap 'kill $REG_PID 2>/dev/null || true; wait $REG_PID 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -fsS "http://127.0.0.1:$REG_PORT/v2/" >/dev/null 2>&1 && break; sleep 0.1; done
curl -fsS "http://127.0.0.1:$REG_PORT/v2/" >/dev/null || { cat "$PODMAN_DIR/registry.log" >&2; exit 1; }

push() { podman push -q --tls-verify=false "localhost/$1" "docker://127.0.0.1:$REG_PORT/$1"; }
for kind in "${missing[@]}"; do
  image=$(ref "$kind"); t0=$(date +%s)
  podman image exists "localhost/$image" && kind="(built)"  # built before, not pushed yet
  case "$kind" in
    pause)
      step "pause image $image"
      ctx="$CACHE_ROOT/pause"
      printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$ctx/Containerfile"
      podman build -q -f "$ctx/Containerfile" -t "localhost/$image" "$ctx" >/dev/null ;;
    tiny-model)
      step "modelcar image $image: the seeded tiny model in /models"
      ctx="$CACHE_ROOT/tiny-model-build"
      rm -rf "$ctx"; mkdir -p "$ctx"
      PYTHONPATH="$REPO/runtime:$REPO/contract" "${HOST_PIP_PYTHON:-$REPO/.venv/bin/python}" \
        -m spyre_runtime.cli tiny-model "$ctx/models" >/dev/null
      # readable by any uid: the modelcar's init container runs as the pod's arbitrary user (safetensors
      # writes its files 0600, which that user could not copy)
      chmod -R a+rX "$ctx/models"
      printf 'FROM %s\nCOPY models /models\n' "$BASE_REF" >"$ctx/Containerfile"
      podman build -q -f "$ctx/Containerfile" -t "localhost/$image" "$ctx" >/dev/null
      rm -rf "$ctx" ;;
    runtime|operator)
      file=Containerfile; [ "$kind" = runtime ] && file=Containerfile.runtime
      step "$kind image $image from $file (minutes)"
      # layers are kept: a change of the sources rebuilds only the layers after the dependencies'
      nice -n 10 podman build --network=host --layers -f "$REPO/$file" \
        --build-arg "BASE_IMAGE=$BASE_REF" \
        -v "$WHEELS:/wheels:ro" -v "$WHEELS/pip.conf:/etc/pip.conf:ro" \
        -t "localhost/$image" "$REPO"
      # earlier builds' tags go (their layers stay while a newer build shares them)
      podman images --format '{{.Repository}}:{{.Tag}}' "localhost/${image%%:*}" | grep -vxF "localhost/$image" \
        | xargs -r podman rmi -f >/dev/null 2>&1 || true ;;
  esac
  step "push $image to the local registry"
  push "$image"
  echo "[build-images] image $image in $(( $(date +%s) - t0 )) s"
done
echo "[build-images] done in $(( $(date +%s) - start )) s"
exit
}
