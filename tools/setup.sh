#!/usr/bin/env bash
# Sets up Genie in ./.venv on a fresh machine with Python 3.11: torch 2.13.0 (CPU build, pinned
# first so pip never resolves a multi-GB CUDA torch), the test tools, Ray (genie-pool's launcher;
# GENIE_SETUP_RAY=0 skips it), and Genie itself with its native runtime (csrc/) compiled against
# that torch. Idempotent: a second run only rebuilds when
# csrc/ or setup.py changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3 python; do
    if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: no python3.11 found; install Python 3.11 first" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! $VPY -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] in ('2.13.0', '2.11.0') else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (a large download: a minute or more)..."
  $VPY -m pip install -q "torch==2.13.0"
fi
echo "setup: installing build and test dependencies..."
$VPY -m pip install -q "setuptools>=64" wheel ninja optree numpy "pytest>=8" "pytest-benchmark>=4" \
  expecttest "transformers>=4.45" pyzmq msgpack
# genie-pool's default launcher runs servers as Ray actors; with Ray here its tests run too
# (measured: ~12 s and ~260 MB on a fresh venv). GENIE_SETUP_RAY=0 skips it: those tests then
# skip, saying why, and genie-pool --launcher process still works.
if [ "${GENIE_SETUP_RAY:-1}" != "0" ]; then
  if ! $VPY -c "import ray" 2>/dev/null; then
    echo "setup: installing ray (genie-pool's Ray launcher; GENIE_SETUP_RAY=0 skips it)..."
    $VPY -m pip install -q "ray==2.60.0"
  fi
fi

stamp=.venv/.genie-build-stamp
want=$(cat setup.py pyproject.toml csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ "$(cat $stamp 2>/dev/null)" != "$want" ] || ! $VPY -c "import genie" 2>/dev/null; then
  echo "setup: building genie (native runtime in csrc/, about a minute)..."
  # the distribution was named "genie" before (a name taken on PyPI): drop that old install
  if $VPY -m pip show -q genie >/dev/null 2>&1; then $VPY -m pip uninstall -y -q genie; fi
  # No autoload while building: setup.py imports torch, and torch would import the installed
  # genie, whose Python may need native functions the stale genie._C does not have yet.
  TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS=${MAX_JOBS:-2} \
    $VPY -m pip install -q --no-build-isolation --no-deps -e .
  echo "$want" > $stamp
fi
$VPY -c "import torch, genie; print('setup: genie ready, torch', torch.__version__, '| remote_accelerator ->', genie.device.real_device(0))"
