#!/usr/bin/env bash
# One check of Genie's CUDA paths on a machine with an NVIDIA GPU and a preinstalled CUDA torch
# (the workplace's lent device machine: Python 3.12, torch 2.11 + CUDA, no network). In order of
# what matters most, each step logged under $OUT (default /tmp/genie-gpu) so a run cut short still
# tells what it reached:
#   1. builds genie._C against that torch in place (the build on torch 2.11 is exercised nowhere
#      else), then eager CUDA autograd where Genie is installed (`import torch` alone must leave it
#      working), 2. runs the demo (remote_accelerator -> cuda:0), 3. bench_models.py's rows with eager
#   on CUDA too, 4. bench_remote_models.py's rows through a loopback CUDA server (eager on CUDA
#   beside it), 5. the unit suite and the model tests on CUDA, in parallel workers.
# Python packages the machine lacks travel as wheels in .whl/ (see docs/testing.md).
# Usage: bash tools/gpu_check.sh [bench -k expression]
# A re-check after fixes, in less device time: SKIP="native demo bench remote" (steps to skip) and
# TEST_FILES="tests/unit/test_x.py ..." (instead of the default test list).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/genie-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

stamp "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
  $PY -c "import transformers, sympy; print('transformers', transformers.__version__, '| sympy', sympy.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

if compgen -G ".whl/*.whl" >/dev/null; then  # into the interpreter's own environment, so the
  # subprocesses tests start find them too (the machine is discarded after the run)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

stamp "build"
# the H200 image's CXX (/opt/gcc/bin/g++) links libstdc++ statically, which setup.py refuses
# after a whole build (~50 s of device time): take the system g++ first where there is one
if [[ -z "${CXX:-}" ]] && command -v g++ >/dev/null; then export CXX=g++; fi
build() { TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace -q \
    >>"$OUT/build.log" 2>&1; }
if ! build; then
  # setup.py refuses a genie._C linked with a static libstdc++ (the H200 image's CXX,
  # /opt/gcc/bin/g++, does that: every C++ exception torch caught from it was a segfault)
  if grep -q "static copy of the C++ runtime" "$OUT/build.log"; then
    echo "CXX=${CXX:-unset} links libstdc++ statically (setup.py refused it); building with CXX=g++"
    CXX=g++ build || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  else
    grep -E "error|Error" "$OUT/build.log" | head -40
    exit 1
  fi
fi
readelf -d genie/_C*.so | grep NEEDED | grep -E "libstdc|libgcc_s" || true
$PY -c "import genie, torch; from genie import _C; print('genie on', genie.device.real_device(0), '| native record', _C._record_native)" 2>&1 | tee -a "$OUT/machine.txt"

skip() { [[ " ${SKIP:-} " == *" $1 "* ]] && echo "(skipped: SKIP has $1)"; }

stamp "native errors"
skip native ||   # a C++ error raised inside genie._C must reach Python as an exception
{ g++ --version | head -1
  # the compiler the build used (CXX, else c++: on the H200 image the build ran /opt/gcc/bin/g++,
  # not the g++ above) and the C++ runtime the module resolves at run time
  echo "CXX=${CXX:-unset}: $(${CXX:-c++} --version | head -1)"
  ldd genie/_C*.so | grep -E "libstdc|libgcc_s" || true
  $PY -c "import torch; print('torch built with:', [l.strip() for l in torch.__config__.show().splitlines() if 'GCC' in l or 'CXX_COMPILER' in l or 'CXX11_ABI' in l][:3])"
  $PY -c "import genie; from genie import _C; _C._set_device_count(0)" 2>&1 | tail -3
  $PY -c "import torch, genie; torch.Generator(device='remote_accelerator:9')" 2>&1 | tail -3
} 2>&1 | tee "$OUT/native_errors.txt"

stamp "beside"  # eager CUDA autograd on a machine where Genie is installed (pytorch#161129)
skip beside ||
{ $PY -c "
import torch, _genie_autoload as a
print('accelerator beside:', a.accelerator_beside())
a.autoload()  # what import torch runs where Genie is pip-installed
x = torch.randn(4, device='cuda', requires_grad=True)
(x * 2).sum().backward()
print('after import torch: PrivateUse1 is', torch._C._get_privateuse1_backend_name(), '| eager CUDA backward ok:', x.grad.tolist() == [2.0] * 4)
"
  $PY -c "
import torch, genie
x = torch.randn(4, device='cuda', requires_grad=True)
try:
    (x * 2).sum().backward(); print('after import genie: eager CUDA backward ran')
except RuntimeError as e:
    print('after import genie:', str(e)[:90], '| cause:', str(e.__cause__)[:60])
"
} 2>&1 | tee "$OUT/beside.txt"

stamp "demo"
skip demo || timeout 120 $PY -m genie.demo >"$OUT/demo.txt" 2>&1; echo "demo rc=$?"; tail -4 "$OUT/demo.txt"

stamp "bench"
skip bench || GENIE_BENCH_ROUNDS=${GENIE_BENCH_ROUNDS:-1} timeout ${BENCH_TIMEOUT:-200} \
  $PY -m pytest bench/bench_models.py --benchmark-only -q -p no:cacheprovider ${1:+-k "$1"} \
  >"$OUT/bench.txt" 2>&1
echo "bench rc=$?"; grep -E "^\[|: eager|load average" "$OUT/bench.txt" | cut -c1-400

stamp "remote bench"  # a CUDA genie-server on this host; eager on CUDA in the client's process
skip remote || GENIE_BENCH_SERVER_DEVICE=cuda GENIE_BENCH_SERVER_LOG="$OUT/server.log" timeout ${REMOTE_BENCH_TIMEOUT:-200} \
  $PY -m pytest bench/bench_remote_models.py --benchmark-only -q -p no:cacheprovider \
  -k "${REMOTE_K:-decode or generate or round}" >"$OUT/remote_bench.txt" 2>&1
echo "remote bench rc=$?"; grep -E "^\[|: eager|load average|x eager" "$OUT/remote_bench.txt" | cut -c1-400

stamp "tests"
workers=$(( $(nproc) > 14 ? 14 : $(nproc) ))
# -v names each result as it comes and --instafail (pytest-instafail, a wheel in .whl/) prints each
# failure's traceback at once: a run cut by its timeout (the device time ends) still says what
# failed and why (session 48's second run kept only the names of 23 failures)
insta=$($PY -c "import pytest_instafail" 2>/dev/null && echo --instafail)
timeout ${TEST_TIMEOUT:-240} $PY -m pytest ${TEST_FILES:-tests/unit tests/integration/test_models.py tests/integration/test_remote.py tests/integration/test_server_index_check.py tests/integration/test_shape_class.py} ${TESTS:-} -v $insta --tb=short \
  -n "$workers" -p no:cacheprovider -o addopts="" -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning >"$OUT/tests.txt" 2>&1
echo "tests rc=$?"
grep -E "(FAILED|ERROR) tests/" "$OUT/tests.txt" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | cut -c1-300 | head -60
echo "passed: $(grep -c "PASSED tests/" "$OUT/tests.txt")"; tail -1 "$OUT/tests.txt" | cut -c1-300
stamp "end"
