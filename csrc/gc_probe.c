/* Build-time probe (setup.py compiles and runs it; it is not part of genie._C): where this
 * CPython keeps the cyclic collector's young-generation threshold and allocation count, as
 * offsets into PyInterpreterState, from the interpreter's own internal headers. genie._C takes
 * the untracked objects it allocates off that count (csrc/gccount.cpp), and checks both offsets
 * against the gc module at import before it uses them. CPython 3.11 and 3.12 only: 3.13's
 * incremental collector counts differently, and there this probe does not build. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030D0000
#error "the young generation's count is probed on CPython 3.11 and 3.12 only"
#endif
#include "internal/pycore_interp.h"

int main(void) {
  printf("%zu %zu\n", offsetof(PyInterpreterState, gc.generations[0].threshold),
         offsetof(PyInterpreterState, gc.generations[0].count));
  return 0;
}
