"""Device memory accounting and the ``torch.cuda``-shaped memory/stream API of the device module.

What the figures mean (``torch.remote_accelerator.memory_allocated()`` and friends):

- real device CUDA (embedded): ``torch.cuda``'s own figures for the mapped ``cuda:N`` (everything
  this process holds there, Genie's values included), and ``Stream``/``Event`` are CUDA streams and
  events on it.
- real device CPU (embedded): the bytes of the distinct real storages that Genie's executor holds
  for this process (values that live tensors still need, and values handed back by
  :func:`genie.materialize` while the caller holds them). The peak also counts the values alive
  *during* a run: each tape's high-water mark of live fresh outputs (from the planner's
  free-after-last-use lists and output metadata, as the eager interpreter holds them) is added to
  what was held when the run began. ``Stream``/``Event`` are ordering points (work runs in
  program order on the host).
- server-backed: the bytes the server holds for this session, as reported in every reply
  (``resident_bytes``); the peak is the largest figure seen in a reply (transients inside one
  request are not reported by the server).

Invariants: accounting is keyed by real storage (views are counted once); it runs only on the cold
path (after a run binds its values), never while recording.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._C import _mem_allocated, _mem_hold
from .config import config
from .device import _index, check_index, real_device
from .errors import DeviceError
from .meta import policy

_peak: dict[int, int] = {}
_seen: set[int] = set()  # device indices a run has held values on
# The held storages themselves live in genie._C (csrc/memory.cpp): a weak pointer per distinct
# real CPU storage, so accounting a kept value is a hash lookup (no Python object per value).


_tracking = [False]  # tape high-water marks are computed once someone asks for a peak


def _no_sessions() -> list[Any]:
    return []


#: the connected server sessions by device index (``genie.backends.remote.clients``, which sits
#: above this module and installs itself here when it loads)
sessions: list[Callable[[], list[Any]]] = [_no_sessions]


def _remote_session(index: int) -> Any:
    cl = sessions[0]()
    return cl[index] if index < len(cl) else None


def session_quota(index: int) -> int | None:
    """The quota (bytes) of this process's session on the server of ``remote_accelerator:index``
    (None: embedded, or a server that did not say)."""
    s = _remote_session(index)
    q = s.info.get("quota") if s is not None else None
    return q if type(q) is int and q > 0 else None


_real = real_device


def hold(index: int, values: Any) -> None:
    """Count the real CPU storages of ``values`` as held on ``remote_accelerator:index`` while
    they live (server handles and CUDA tensors are accounted elsewhere)."""
    held(index, _mem_hold(index, values))


def held(index: int, allocated: int) -> None:
    """Account values ``genie._C._mem_hold`` held on ``index``; ``allocated``: its answer."""
    _seen.add(index)
    if allocated > _peak.get(index, 0):
        _peak[index] = allocated


def held_here(index: int) -> bool:
    """Whether :func:`after_run` holds a run's values on ``index`` in the CPU accounting, as an
    earlier run set it up, and tracks no peak: the executor's fused hit then holds them itself
    (``genie._C._hit_run``) and reports to :func:`held`."""
    return not _tracking[0] and _cpu[0] is not None and _real(index) is _cpu[0]


def _allocated(index: int) -> int:
    return _mem_allocated(index)


_cpu: list[Any] = [None]  # the last local device after_run found to be the CPU

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None)


_MADV_HUGEPAGE = 14  # madvise advice (linux/mman.h)
_HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
_madvise: list[Any] = []  # libc's madvise with its argument types, once; None where absent


def fresh_bytes(n: int) -> torch.Tensor:
    """``n`` uninitialized bytes (a uint8 tensor, aligned as torch aligns) for a buffer about to
    be written whole, with the 2 MiB-aligned span inside it marked for transparent huge pages
    (Linux ``madvise(MADV_HUGEPAGE)``, which systems in THP ``madvise`` mode honour): first
    writes then fault one page per 2 MiB instead of one per 4 KiB, and filling a fresh 128 MiB
    buffer takes about a quarter of the time (docs/benchmarks.md, the upload row). Where the
    advice is not available or refused, plain memory."""
    t = torch.empty(n, dtype=torch.uint8)
    if n >= 2 * _HUGE_PAGE:
        if not _madvise:
            import ctypes

            try:
                f = ctypes.CDLL(None).madvise
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _madvise.append(f)
            except (OSError, AttributeError):
                _madvise.append(None)
        if _madvise[0] is not None:
            a = t.data_ptr()
            lo = -(-a // _HUGE_PAGE) * _HUGE_PAGE
            hi = (a + n) // _HUGE_PAGE * _HUGE_PAGE
            _madvise[0](lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return t


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free pages of every arena back to the OS; False where there is
    no glibc."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def retain_host_memory(limit: int) -> bool:
    """Keep up to ``limit`` bytes of freed host memory for reuse instead of handing it back to the
    OS after every run (what CUDA's caching allocator does for device memory; ``empty_cache()``
    hands it back). Called once, at the first run on the CPU: a program that never touches the
    device keeps glibc's defaults.

    Why: a replay frees its intermediate values together at the end of the run, so the top of the
    heap is one large free region that glibc trims (its dynamic trim threshold is twice the
    largest chunk it once mapped); the next run faults every page in again and zero-fills it.
    Eager frees as it goes and reuses. Measured on a GPT-2 12x768 AdamW step (1 thread): 57,568
    minor page faults per step, ~100 ms of system time on a ~400 ms step (1.34x eager); 0 with the
    thresholds fixed. Fixing them also stops glibc's dynamic mmap threshold, so allocations below
    32 MiB come from the heap from the start (eager reaches that after its first steps).
    ``limit`` 0 leaves glibc's defaults. Returns whether glibc took the settings."""
    if limit <= 0:
        return False
    try:
        libc = _libc()
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) and
                    libc.mallopt(_M_TRIM_THRESHOLD, min(limit, (1 << 31) - 1)))
    except (OSError, AttributeError):  # not glibc
        return False


def retain_limit() -> int:
    """Bytes of freed host memory to keep: ``GENIE_CPU_RETAIN`` (``config.cpu_retain``, MiB; 0
    turns retention off), by default 1 GiB or an eighth of the host's memory, whichever is less."""
    if config.cpu_retain is not None:
        return config.cpu_retain << 20
    import os

    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        phys = 8 << 30
    return min(1 << 30, phys // 8)


_retaining: list[bool | None] = [None]  # None: no run on the CPU yet; then whether glibc retains


def after_run(tape: Any, kept: dict[int, Any], index: int, high_water: int | None = None
              ) -> None:
    """Account a finished run on ``remote_accelerator:index`` (called by the executor);
    ``high_water``: the run's :func:`tape_high_water`, when the caller knows it (``tape`` is then
    not read)."""
    try:
        local = _real(index)
    except DeviceError:  # no local device for this index (one GPU, two servers): a server ran it
        return
    if local is not _cpu[0]:  # (device.type builds a string per read: checked once per device)
        if local.type != "cpu":
            return
        _cpu[0] = local
        if _retaining[0] is None:
            _retaining[0] = retain_host_memory(retain_limit())
    if _tracking[0]:
        before = _allocated(index)
        hw = tape_high_water(tape) if high_water is None else high_water
        if before + hw > _peak.get(index, 0):
            _peak[index] = before + hw
    hold(index, kept.values())


def note_run(index: int, high_water: int) -> None:
    """A run on ``index`` whose live fresh values peaked at ``high_water`` bytes."""
    p = _allocated(index) + high_water
    if p > _peak.get(index, 0):
        _peak[index] = p


def tracking() -> bool:
    """Whether runs compute their tapes' high-water marks (someone asked for a peak)."""
    return _tracking[0]


def tape_high_water(tape: Any) -> int:
    """Bytes of fresh outputs alive at once while the eager interpreter runs ``tape`` (a bound).

    Views and in-place results share their input's storage and add nothing; a fresh output is
    alive from its instruction until the instruction that frees its slot (the planner's list).
    """
    live = 0
    peak = 0
    size: dict[int, int] = {}
    for ins, node in zip(tape.instrs, tape.nodes):
        if isinstance(ins.op, str):  # uploads: a fresh copy of host data
            fresh = [(s, m) for s, m in zip(ins.outs, node.metas) if s is not None]
        else:
            rets = policy(ins.op).returns
            fresh = [(s, m) for k, (s, m) in enumerate(zip(ins.outs, node.metas))
                     if s is not None and m is not None and
                     (rets[0] if len(rets) == 1 else (rets[k] if k < len(rets) else None)) is None]
        for s, m in fresh:
            b = _nbytes(m)
            size[s] = b
            live += b
        peak = max(peak, live)
        for s in ins.free:
            live -= size.pop(s, 0)
    return peak


def _nbytes(m: Any) -> int:
    if any(d == 0 for d in m.shape):
        return 0
    return (m.offset + 1 + sum((d - 1) * st for d, st in zip(m.shape, m.stride))) * \
        m.dtype.itemsize


# --- the torch.cuda-shaped API (re-exported by genie.device) -------------------------------------

def _idx(device: Any) -> int:
    i = _index(device)
    check_index(i)
    return i


def _cuda(r: torch.device) -> torch.device:
    """``r`` once CUDA is initialized: its memory statistics refuse a device before that
    ("Invalid device argument": a process whose first CUDA call asks for a peak)."""
    if not torch.cuda.is_initialized():
        torch.cuda.init()
    return r


def memory_allocated(device: Any = None) -> int:
    """Bytes the real device holds for this process (embedded) or this session (server)."""
    i = _idx(device)
    s = _remote_session(i)
    if s is not None:
        return int(s.resident[1])
    r = _real(i)
    if r.type == "cuda":
        return torch.cuda.memory_allocated(_cuda(r))
    return _allocated(i)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`.

    On the CPU, values alive only inside a run count from the first call of this function or
    :func:`reset_peak_memory_stats` on (measuring them costs a pass over each tape).
    """
    _tracking[0] = True
    i = _idx(device)
    s = _remote_session(i)
    if s is not None:
        _peak[i] = max(_peak.get(i, 0), int(s.resident[1]))
        return _peak[i]
    r = _real(i)
    if r.type == "cuda":
        return torch.cuda.max_memory_allocated(_cuda(r))
    return max(_peak.get(i, 0), _allocated(i))


def reset_peak_memory_stats(device: Any = None) -> None:
    """Restart the peak at the current figure (as ``torch.cuda.reset_peak_memory_stats``)."""
    _tracking[0] = True
    i = _idx(device)
    r = _real(i)
    if _remote_session(i) is None and r.type == "cuda":
        torch.cuda.reset_peak_memory_stats(_cuda(r))
    _peak[i] = memory_allocated(i)


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_reserved(device: Any = None) -> int:
    """Bytes reserved by the real device's allocator (CUDA's caching allocator), else allocated."""
    i = _idx(device)
    r = _real(i)
    if _remote_session(i) is None and r.type == "cuda":
        return torch.cuda.memory_reserved(_cuda(r))
    return memory_allocated(i)


def max_memory_reserved(device: Any = None) -> int:
    i = _idx(device)
    r = _real(i)
    if _remote_session(i) is None and r.type == "cuda":
        return torch.cuda.max_memory_reserved(_cuda(r))
    return max_memory_allocated(i)


def empty_cache() -> None:
    """Release cached, unused blocks of the real device's allocator: CUDA's, or on the CPU the
    freed host memory kept for reuse (:func:`retain_host_memory`)."""
    if torch.cuda.is_available() and any(_real(i).type == "cuda" for i in sorted(_seen) or [0]):
        torch.cuda.empty_cache()
    if _retaining[0]:
        malloc_trim()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the real device: CUDA's, or the host's physical memory for the CPU."""
    i = _idx(device)
    r = _real(i)
    if _remote_session(i) is None and r.type == "cuda":
        return torch.cuda.mem_get_info(r)
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


# torch.accelerator's memory API on remote_accelerator: its device type's allocator
# (csrc/allocator.cpp, a c10::DeviceAllocator) answers from these


def _accelerator_stats(index: int) -> tuple[int, int, int, int]:
    """``torch.accelerator.memory_stats(index)``: bytes allocated now and at the peak, reserved
    now and at the peak, as :func:`memory_allocated` and :func:`max_memory_allocated` (which
    starts peak tracking: torch asks for every figure at once) and their ``reserved`` pair."""
    return (memory_allocated(index), max_memory_allocated(index), memory_reserved(index),
            max_memory_reserved(index))


def _accelerator_reset_peak(index: int) -> None:
    reset_peak_memory_stats(index)


def _accelerator_empty_cache(index: int) -> None:  # noqa: ARG001 - every device, as torch's
    empty_cache()


def _accelerator_memory_info(index: int) -> tuple[int, int]:
    return mem_get_info(index)


def get_device_name(device: Any = None) -> str:
    """Name of the real device behind ``remote_accelerator:N``."""
    i = _idx(device)
    s = _remote_session(i)
    if s is not None:
        return f"genie server {s.address}"
    r = _real(i)
    if r.type == "cuda":
        return torch.cuda.get_device_name(r)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


class _DeviceProperties:
    def __init__(self, name: str, total_memory: int, real: str) -> None:
        self.name = name
        self.total_memory = total_memory
        self.real_device = real

    def __repr__(self) -> str:
        return (f"_RemoteAcceleratorDeviceProperties(name='{self.name}', "
                f"total_memory={self.total_memory >> 20}MB, real_device='{self.real_device}')")


def get_device_properties(device: Any = None) -> Any:
    """Properties of the real device (CUDA's own object when it is CUDA)."""
    i = _idx(device)
    r = _real(i)
    if _remote_session(i) is None and r.type == "cuda":
        return torch.cuda.get_device_properties(r)
    return _DeviceProperties(get_device_name(i), mem_get_info(i)[1], str(r))


# --- streams and events -----------------------------------------------------------------------

class Stream:
    """A stream of ``remote_accelerator:N``: a CUDA stream when the real device is CUDA.

    Elsewhere an ordering point: Genie runs work in program order, so ``synchronize`` and
    ``wait_stream`` only need what was already sent to have finished.
    """

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.index = _idx(device)
        self.device = torch.device("remote_accelerator", self.index)
        r = _real(self.index)
        self.cuda = torch.cuda.Stream(r, priority=priority) if r.type == "cuda" else None

    def synchronize(self) -> None:
        if self.cuda is not None:
            self.cuda.synchronize()

    def wait_stream(self, other: Stream) -> None:
        if self.cuda is not None and other.cuda is not None:
            self.cuda.wait_stream(other.cuda)

    def wait_event(self, event: Event) -> None:
        if self.cuda is not None and event.cuda is not None:
            self.cuda.wait_event(event.cuda)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return self.cuda.query() if self.cuda is not None else True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.index == self.index and \
            (self.cuda == other.cuda)

    def __hash__(self) -> int:
        return hash((self.index, self.cuda))


class Event:
    """An event: a CUDA event when the real device is CUDA, else a point already reached."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.cuda: Any = None
        self._kw = dict(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        if stream.cuda is not None:
            if self.cuda is None:
                self.cuda = torch.cuda.Event(**self._kw)
            self.cuda.record(stream.cuda)
        elif self.enable_timing:
            import time

            self._t = time.perf_counter()

    def synchronize(self) -> None:
        if self.cuda is not None:
            self.cuda.synchronize()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.cuda.query() if self.cuda is not None else True

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded with ``enable_timing``)."""
        if self.cuda is not None and end.cuda is not None:
            return self.cuda.elapsed_time(end.cuda)
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True "
                               "and recorded (event.record()) before the call")
        return (end._t - self._t) * 1e3


_current: dict[int, Stream] = {}


def current_stream(device: Any = None) -> Stream:
    """The current stream of ``device`` (the default stream unless inside ``stream(s)``)."""
    i = _idx(device)
    s = _current.get(i)
    if s is None:
        s = _current[i] = default_stream(i)
    return s


_defaults: dict[int, Stream] = {}


def default_stream(device: Any = None) -> Stream:
    i = _idx(device)
    s = _defaults.get(i)
    if s is None:
        s = Stream.__new__(Stream)
        s.index, s.device = i, torch.device("remote_accelerator", i)
        r = _real(i)
        s.cuda = torch.cuda.default_stream(r) if r.type == "cuda" else None
        _defaults[i] = s
    return s


class stream:  # noqa: N801 (the torch.cuda.stream spelling)
    """Context manager making ``s`` the current stream (and the CUDA one, on CUDA)."""

    def __init__(self, s: Stream | None) -> None:
        self.s = s
        self.prev: Stream | None = None
        self.cuda_ctx: Any = None

    def __enter__(self) -> Stream | None:
        if self.s is None:
            return None
        self.prev = current_stream(self.s.index)
        _current[self.s.index] = self.s
        if self.s.cuda is not None:
            self.cuda_ctx = torch.cuda.stream(self.s.cuda)
            self.cuda_ctx.__enter__()
        return self.s

    def __exit__(self, *exc: object) -> None:
        if self.s is None:
            return
        if self.cuda_ctx is not None:
            self.cuda_ctx.__exit__(*exc)
        _current[self.s.index] = self.prev  # type: ignore[assignment]


def set_stream(s: Stream) -> None:
    _current[s.index] = s


#: what ``torch.remote_accelerator`` (the module :mod:`genie.device`) takes from here: the
#: torch.cuda names of memory and streams (installed by ``import genie``, :func:`install`; the
#: device module sits below this one)
DEVICE_MODULE_NAMES = (
    "Event", "Stream", "current_stream", "default_stream", "empty_cache", "get_device_name",
    "get_device_properties", "max_memory_allocated", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_reserved", "reset_max_memory_allocated", "reset_peak_memory_stats",
    "set_stream", "stream")


def install(module: Any) -> None:
    """Give the device module (``torch.remote_accelerator``) the names of
    :data:`DEVICE_MODULE_NAMES`."""
    for name in DEVICE_MODULE_NAMES:
        setattr(module, name, globals()[name])
