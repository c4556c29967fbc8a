#!/usr/bin/env bash
# tests/unit on another CPython than CI's 3.11 (default 3.12, the GPU machine's), on the CPU.
#
# genie._C reads some CPython objects in place (an int's sign and digits, a managed dict's
# place): their layout changes between Python versions, and CI runs 3.11 only. Session 56 found
# that way a liveness count read with 3.11's layout on the H200's Python 3.12: every plan missed.
# This builds genie._C for that interpreter beside the 3.11 one (the extension's file name carries
# its ABI tag, so both live in genie/) and runs the unit suite with it.
#
# Usage: bash tools/other_python.sh [pytest args]   (PYV=3.13, VENV=/path to reuse a venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYV:-3.12}
PY=$(command -v "python$PYV" || true)
if [[ -z "$PY" ]]; then
  echo "other_python: no python$PYV on PATH (install it, or set PYV to one that is)" >&2
  exit 2
fi
VENV=${VENV:-.venv$PYV}
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "other_python: making $VENV with $("$PY" --version) (torch 2.13.0 first: never an open range)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q "setuptools>=64" wheel ninja optree numpy "pytest>=8" \
    "pytest-benchmark>=4" expecttest msgpack pyzmq "transformers>=4.45"
fi
echo "other_python: building genie._C for $("$VENV/bin/python" --version) (a few minutes)"
TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py build_ext \
  --inplace -q >"$VENV/build.log" 2>&1 || { tail -30 "$VENV/build.log"; exit 1; }
PYTHONPATH=$PWD exec "$VENV/bin/python" -m pytest tests/unit -q -p no:cacheprovider -o addopts="" "$@"
