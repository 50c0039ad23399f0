#!/usr/bin/env bash
# Prometheus and promtool for tests (issue 41): Debian's `prometheus` package, its two binaries taken out of
# the .deb (`apt-get download` + `dpkg-deb -x`) instead of installed, so no prometheus service is set up or
# started on the machine; the tests start their own on 127.0.0.1 and stop it by PID. Cached beside the
# control plane's binaries; a second run with them present does nothing. Test infrastructure only.
set -euo pipefail

CACHE_ROOT="${SPYRE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spyre-serve}"
OUT="$CACHE_ROOT/prometheus/bin"

if [ -x "$OUT/promtool" ] && [ -x "$OUT/prometheus" ]; then
  exit 0
fi
trap 'echo "[build-prometheus] FAILED (see output above)" >&2' ERR
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 777 "$work"  # apt's _apt user writes the download here
echo "[build-prometheus] apt-get download prometheus"
if ! (cd "$work" && apt-get download -qq prometheus 2>/dev/null); then
  $SUDO apt-get update -qq
  (cd "$work" && apt-get download -qq prometheus)
fi
deb=$(ls "$work"/prometheus_*.deb)
dpkg-deb -x "$deb" "$work/root"
mkdir -p "$OUT"
for b in prometheus promtool; do
  install -m 0755 "$work/root/usr/bin/$b" "$OUT/$b.tmp"
  mv "$OUT/$b.tmp" "$OUT/$b"
done
echo "[build-prometheus] $("$OUT/promtool" --version 2>&1 | head -1) in $OUT"
