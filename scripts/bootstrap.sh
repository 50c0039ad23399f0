#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install everything into it.
# torch==2.13.0 goes in first and stays pinned by constraints.txt, so nothing resolves a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPYRE_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
STAMP="$VENV/.spyre-installed"

say() { echo "[bootstrap] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  say "installing torch==2.13.0 first (CPU wheel)"
  "${PIP[@]}" install torch==2.13.0
fi

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ]; then
  say "installing spyre-serve with extras operator,runtime,test,dev (constraints.txt pins torch)"
  "${PIP[@]}" install -c constraints.txt -e ".[operator,runtime,test,dev]"
  touch "$STAMP"
else
  say "reusing $VENV (delete $STAMP to reinstall)"
fi

# On a machine without an accelerator the torch build must be the CPU one.
"$VENV/bin/python" - <<'PY'
import os, shutil, sys, torch
has_accel = bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidiactl")
version = torch.__version__
if not has_accel and not version.endswith("+cpu"):
    sys.exit(f"[bootstrap] torch {version} is not the CPU build (expected 2.13.0+cpu) on a machine "
             "without an accelerator: a dependency pulled a CUDA build; reinstall with `pip install torch==2.13.0`")
print(f"[bootstrap] torch {version} OK")
PY
