"""CUDA graphs for steady plans: a native program's stable window replayed as one launch.

On CUDA, eager pays a kernel launch per op and Genie's native replay
(:mod:`~genie.backends.native_replay`) pays the same launches one after the other: a GPT-2
decode step is ~500 launches. But a plan that repeats is a structure known before it runs, so
its launches can be recorded once as a CUDA graph and replayed as one (eager gets this only when
the user rewrites the step around ``torch.cuda.graph``). This module does that for every native
program on a CUDA device, without changes to the user's program:

1. **Observe.** The program's first :data:`WARM_RUNS` runs are plain; each compares the step's
   per-step parameters (the leaves the program patches per step: floats, ints of a shape-generic
   tape, host tensors, metadata arguments) and its inputs' identities (address, sizes, strides,
   dtype) with the run before.
2. **Window.** The longest run of instructions in which no parameter varied, no random op
   (its seed and offset change per step), no data-dependent op (a host sync, which a capture
   refuses) and no instruction of another device is the window ``[a, b)``; uploads inside it are
   hoisted before it (they read only the step's host tensor). Instructions before it (and the
   hoisted uploads) run as one native program, those after it as another, every step: a
   ``pos.fill_(p)`` at the head of a decode step runs plainly, the model after it is graphed.
3. **Capture.** The window runs plainly on a side stream (this step's values, and the warm-up a
   capture needs), then is captured. Its inputs whose identity never moved (weights, a static KV
   cache, the optimizer's state) are captured in place, so its in-place writes land in them as
   they would; the others (values the prefix computes, fresh inputs) get a private buffer they
   are copied into before each replay (and back after it, when the window writes them).
4. **Replay.** Per step: the window's parameters compared with the captured ones and the
   in-place inputs' identities checked (a difference runs the step plainly: a miss;
   :data:`MAX_MISSES` in a row drop the graph and observation starts again), the prefix run,
   the buffers filled, one ``replay``, and the window's outputs that live in the graph's memory
   copied out (a storage at a time, views rebuilt on the copy, so aliasing between outputs is
   kept and the next replay cannot overwrite a value a node holds); outputs that are views of an
   in-place input are handed out as views of it.

What is never graphed: a window whose output is a view of a buffered input, or whose capture
raises (an op that syncs with the host, say): the program runs plainly from then on, counted in
``cuda_graph_refused`` (the reason at ``GENIE_DEBUG=2``). Values equal the plain run's op for op:
the same kernels, launched from a graph.

``GENIE_CUDA_GRAPHS`` (``genie.config.cuda_graphs``): ``1`` (default: programs whose device is
CUDA), ``0`` (never), ``emulate``: the same bookkeeping on any device, with the window run again
in place of a graph's replay from the captured step's parameters, into the captured outputs'
memory (so every hazard a graph has, stale parameters, overwritten outputs, in-place inputs,
buffered inputs written, shows on the CPU: ``tests/unit/test_cuda_graphs.py``). Counters:
``cuda_graph_captures``, ``cuda_graph_replays``, ``cuda_graph_misses``, ``cuda_graph_refused``.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import torch

from .. import graphs
from ..config import config, logger
from ..device import real_device
from ..graph import MetaArg
from ..passes.budget import memory_budget
from ..planner import Slot, storage_effects
from ..stats import bump

MODES = ("1", "0", "emulate")
WARM_RUNS = 3      # plain runs compared before a capture
MIN_WINDOW = 8     # ops in a window worth a graph
MAX_MISSES = 3     # misses in a row that drop a graph
MAX_CAPTURES = 3   # captures of one program, at most
MAX_NARROW = 8     # windows narrowed (an input of another shape) before a program runs plainly
MAX_GRAPHS = 32    # graphs held at once (their memory pools), the oldest dropped first

_OBSERVE, _CAPTURE, _READY, _OFF = range(4)
# runners holding a graph, oldest first (weakly: a plan the cache drops takes its program, the
# program its runner, the runner its graph and the graph's memory pool)
_held: list[weakref.ref[_Runner]] = []


def mode() -> str:
    m = config.cuda_graphs
    if m not in MODES:
        raise ValueError(f"GENIE_CUDA_GRAPHS={m!r}: expected '1' (default), '0' or 'emulate'")
    return m


def install(native: Any, tape: Any, leafy: list[tuple[int, int]], uploads: list[int],
            generic: bool, compile_tape: Callable[..., Any]) -> None:
    """Give ``native`` (a ``genie._C._ReplayProgram`` compiled from ``tape``) a graph hook when
    graphs apply to its device; ``leafy``: its per-step leaves as (instruction, leaf position),
    ``uploads``: its upload instructions; ``compile_tape``: native_replay's, which compiles the
    parts of a split program."""
    m = mode()
    if m == "0":
        return
    if m == "1" and real_device(tape.index).type != "cuda":
        return
    native.set_graph_hook(_Runner(tape, leafy, uploads, generic, m == "emulate", compile_tape))


def _same(a: Any, b: Any) -> bool:
    """Whether two per-step leaves are the same parameter (what a graph bakes in)."""
    t = type(a)
    if t is not type(b):
        return False
    if t is MetaArg:
        x, y = a.meta, b.meta
        return x.shape == y.shape and x.stride == y.stride and x.dtype == y.dtype
    if isinstance(a, torch.Tensor):  # a host tensor: small ones compared by value
        return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.numel() <= 64 and
                          a.stride() == b.stride() and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a leaf that cannot be compared varies
        return False


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its elements' span exactly once (contiguous in some dim order)."""
    if t.is_contiguous():
        return True
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != span:
            return False
        span *= size
    return True


def _ident(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _slots(x: Any, out: list[int]) -> None:
    for leaf in x:
        if type(leaf) is Slot:
            out.append(leaf.id)


class _Part:
    """One of a split program's parts: its program, its instructions' positions in the whole
    (a step's instructions are read at them) and its inputs."""

    __slots__ = ("program", "at", "inputs", "keep")

    def __init__(self, program: Any, at: list[int], inputs: list[int], keep: list[int]) -> None:
        self.program = program
        self.at = at
        self.inputs = inputs
        self.keep = keep

    def run(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        r = self.program.run_plain(inputs, [src[i] for i in self.at], devices)
        if type(r) is tuple:  # (instruction, exception, live): the whole program's index
            return (self.at[r[0]], r[1], {**inputs, **r[2]})
        return r


class _Runner:
    """A program's graph hook (see the module docstring)."""

    def __init__(self, tape: Any, leafy: list[tuple[int, int]], uploads: list[int],
                 generic: bool, emulate: bool, compile_tape: Callable[..., Any]) -> None:
        self.compile_tape = compile_tape
        self.native: Any = None  # the program, during a call (it passes itself: no cycle)
        self.instrs = list(tape.instrs)
        # the whole program's highest slot (its parts number their registers as it does)
        self.top = max([*tape.inputs, *tape.keep,
                        *(o for ins in tape.instrs for o in ins.outs if o is not None)],
                       default=-1)
        self.index = tape.index
        self.keep = sorted(tape.keep)
        self.leafy = leafy
        self.uploads = set(uploads)
        self.generic = generic
        self.emulate = emulate
        self.state = _OBSERVE
        self.captures = 0
        self.narrowed = 0
        self._reset()

    def _reset(self) -> None:
        self.seen = 0
        self.last: list[Any] | None = None
        self.ident: dict[int, Any] | None = None
        self.varying: set[int] = set()
        self.moved: set[int] = set()     # inputs whose identity changed between runs
        self.reshaped: set[int] = set()  # inputs whose sizes, strides or dtype changed
        self.misses = 0
        self.graph: Any = None
        self.parts: tuple[_Part, _Part, _Part] | None = None

    def off(self, why: str) -> None:
        logger.debug("genie: CUDA graph refused for a program of %d instructions: %s",
                     len(self.instrs), why)
        bump("cuda_graph_refused")
        self._drop()
        self.state = _OFF
        self.native.set_graph_hook(None)

    def _drop(self) -> None:
        self.graph = None
        self.parts = None
        _held[:] = [r for r in _held if r() is not None and r() is not self]

    def __call__(self, native: Any, inputs: dict[int, Any], src: list, devices: list) -> Any:
        self.native = native
        try:
            return self._call(inputs, src, devices)
        finally:
            self.native = None

    def _call(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        st = self.state
        if st == _READY:
            return self._replay(inputs, src, devices)
        if st == _CAPTURE:
            return self._capture(inputs, src, devices)
        if st == _OFF:
            return self.native.run_plain(inputs, src, devices)
        if not self.emulate and torch.device(devices[0]).type != "cuda":
            self.off("not a CUDA device")
            return self.native.run_plain(inputs, src, devices)
        return self._observe(inputs, src, devices)

    # -- observation --------------------------------------------------------------------------

    def _sig(self, src: list) -> list[Any]:
        return [src[i].leaves[p] for i, p in self.leafy]

    def _observe(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        sig = self._sig(src)
        ident = {s: _ident(t) for s, t in inputs.items()}
        r = self.native.run_plain(inputs, src, devices)
        if type(r) is tuple:
            return r
        if self.last is not None:
            for (i, _), a, b in zip(self.leafy, self.last, sig):
                if i not in self.varying and not _same(a, b):
                    self.varying.add(i)
            old = self.ident
            for s, v in ident.items():
                o = old.get(s)
                if o != v:
                    self.moved.add(s)
                    if o is None or v is None or o[1:4] != v[1:4]:
                        self.reshaped.add(s)
        self.last, self.ident = sig, ident
        self.seen += 1
        if self.seen >= WARM_RUNS:
            self._plan()
        return r

    def _plan(self) -> None:
        """Choose the window and split the program around it (state: capture), or turn off."""
        if memory_budget() is not None:
            self.off("a memory budget is set (a graph holds its window's memory)")
            return
        n = len(self.instrs)
        bad = set(self.varying)
        for i, ins in enumerate(self.instrs):
            if self.reshaped:
                used: list[int] = []
                _slots(ins.leaves, used)
                if not self.reshaped.isdisjoint(used):
                    bad.add(i)  # (its values' shapes change: so would the graph's)
            if i in self.uploads:
                if ins.free:
                    bad.add(i)
                continue
            op = ins.op
            if ins.rng is not None or ins.device != self.index or \
                    not isinstance(op, torch._ops.OpOverload) or \
                    op is graphs.GRAPH_OP or op is graphs.GRAPH_MUT_OP or \
                    torch.Tag.data_dependent_output in op.tags or \
                    torch.Tag.dynamic_output_shape in op.tags:
                bad.add(i)
        best, a = (0, 0, 0), 0
        for i in range(n + 1):
            if i == n or i in bad:
                ops = sum(1 for j in range(a, i) if j not in self.uploads)
                if ops > best[0]:
                    best = (ops, a, i)
                a = i + 1
        ops, a, b = best
        if ops < MIN_WINDOW:
            self.off(f"no window of {MIN_WINDOW} ops without per-step parameters "
                     f"(longest: {ops}; {len(bad)} of {n} instructions vary)")
            return
        hoist = [i for i in range(a, b) if i in self.uploads]
        first = [*range(a), *hoist]
        mid = [i for i in range(a, b) if i not in self.uploads]
        last = list(range(b, n))
        try:
            self.parts = self._split([first, mid, last])
        except Exception as e:  # noqa: BLE001 - a window that cannot be compiled: plain runs
            self.off(f"the window does not compile ({e})")
            return
        self.window = (a, b)
        self.state = _CAPTURE

    def _split(self, groups: list[list[int]]) -> tuple[_Part, _Part, _Part]:
        later: list[set[int]] = []
        need = set(self.keep)
        for g in reversed(groups):  # the slots each part's successors read, or the run keeps
            later.append(set(need))
            for i in g:
                used: list[int] = []
                _slots(self.instrs[i].leaves, used)
                need.update(used)
        later.reverse()
        parts = []
        for g, after in zip(groups, later):
            defined: set[int] = set()
            reads: list[int] = []
            for i in g:
                ins = self.instrs[i]
                used: list[int] = []
                _slots(ins.leaves, used)
                reads += [s for s in used if s not in defined]
                defined.update(o for o in ins.outs if o is not None)
            keep = sorted(defined & after)
            sub = SimpleNamespace(instrs=[self.instrs[i] for i in g], keep=set(keep),
                                  inputs=dict.fromkeys([self.top, *reads]),
                                  index=self.index)
            prog = self.compile_tape(sub, self.generic, cuda_graph=False) if g else None
            parts.append(_Part(prog.native if prog is not None else None, g,
                               sorted(set(reads)), keep))
        return parts[0], parts[1], parts[2]

    # -- capture ------------------------------------------------------------------------------

    def _writes(self, mid: list[int], buffered: set[int]) -> set[int]:
        """The buffered inputs the window writes (through a view too), by the ops' schemas."""
        root: dict[int, int] = {s: s for s in buffered}
        written: set[int] = set()
        for i in mid:
            effects = storage_effects(self.instrs[i], root)
            if effects is None:  # (not followed: every buffered input is copied back)
                return set(buffered)
            writes, outs = effects
            written.update(writes)
            for o, src in outs:
                if src:
                    root[o] = src[0]
        return written

    def _capture(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        first, mid, last = self.parts
        dev = torch.device(devices[0])
        r1 = first.run(inputs, src, devices) if first.program is not None else {}
        if type(r1) is tuple:
            self.off("its prefix raised")
            return r1
        have = {**inputs, **r1}
        win = {s: have[s] for s in mid.inputs}
        static = {s for s in mid.inputs if s in inputs and s not in self.moved and
                  isinstance(win[s], torch.Tensor)}
        buffered = set(mid.inputs) - static
        for s in buffered:
            t = win[s]
            if not isinstance(t, torch.Tensor) or t.storage_offset() != 0 or \
                    not _dense(t) or \
                    t.untyped_storage().nbytes() != t.numel() * t.element_size():
                r2 = mid.run(win, src, devices)
                self._exclude(s, "a moving input that is not a whole dense storage")
                return self._finish(last, r1, r2, have, src, devices)
        storages = {}
        for s, t in win.items():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(s)
        for s in buffered:
            if len(storages[win[s].untyped_storage().data_ptr()]) > 1:
                r2 = mid.run(win, src, devices)
                self._exclude(s, "a moving input that shares its memory with another")
                return self._finish(last, r1, r2, have, src, devices)
        bufs = {s: torch.empty_strided(win[s].shape, win[s].stride(), dtype=win[s].dtype,
                                       device=win[s].device) for s in buffered}
        for s in buffered:
            bufs[s].copy_(win[s])
        written = self._writes(mid.at, buffered)
        if self.emulate:
            r2 = mid.run(win, src, devices)  # this step's values
            if type(r2) is tuple:
                self.off("its window raised")
                return r2
            out = r2
            graph = [src[i] for i in mid.at]  # the captured step's parameters, replayed
        else:
            stream = torch.cuda.Stream(dev)
            cur = torch.cuda.current_stream(dev)
            stream.wait_stream(cur)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(stream):
                    r2 = mid.run(win, src, devices)  # this step's values, and the warm-up
                    if type(r2) is tuple:
                        cur.wait_stream(stream)
                        self.off("its window raised")
                        return r2
                    static_in = {**{s: win[s] for s in static}, **bufs}
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        out = mid.program.run_plain(static_in, [src[i] for i in mid.at],
                                                    devices)
                    finally:
                        graph.capture_end()
                cur.wait_stream(stream)
            except Exception as e:  # noqa: BLE001 - a window CUDA cannot capture runs plainly
                cur.wait_stream(stream)
                self.off(f"the capture raised {type(e).__name__}: {str(e)[:200]}")
                return self._finish(last, r1, r2, have, src, devices)
            if type(out) is tuple:
                self.off(f"the capture raised {type(out[1]).__name__}: {str(out[1])[:200]}")
                return self._finish(last, r1, r2, have, src, devices)
        # what the window's outputs are: views of an in-place input (handed out as they are),
        # or values in the graph's memory (copied out after every replay, a storage at a time)
        in_place = {win[s].untyped_storage().data_ptr() for s in static}
        moving = {(bufs[s] if not self.emulate else win[s]).untyped_storage().data_ptr()
                  for s in buffered}
        alias, pool = {}, {}
        for s, t in out.items():
            if not isinstance(t, torch.Tensor):
                self.off(f"a window output that is not a tensor (slot {s})")
                return self._finish(last, r1, r2, have, src, devices)
            p = t.untyped_storage().data_ptr()
            if p in moving:
                for m in buffered:
                    if (bufs[m] if not self.emulate else win[m]).untyped_storage().data_ptr() == p:
                        self._exclude(m, "a window output is a view of it")
                return self._finish(last, r1, r2, have, src, devices)
            if p in in_place:
                alias[s] = t
            else:
                pool.setdefault(p, []).append(s)
        if self.emulate:  # the captured outputs' memory, which each replay writes
            placed = {}
            for p, ss in pool.items():
                st = out[ss[0]].untyped_storage()
                mem = torch.empty(st.nbytes(), dtype=torch.uint8, device=dev).untyped_storage()
                for s in ss:
                    t = out[s]
                    placed[s] = torch.empty(0, dtype=t.dtype, device=dev).set_(
                        mem, t.storage_offset(), t.shape, t.stride())
            out = {**out, **placed}
        self.graph = graph
        self.cap = SimpleNamespace(
            out=out, alias=alias, pool=[(ss, out[ss[0]].untyped_storage().nbytes())
                                        for ss in pool.values()],
            static={s: _ident(win[s]) for s in static}, bufs=bufs,
            back=[s for s in buffered if s in written],
            sig=[(k, x) for k, ((i, _), x) in enumerate(zip(self.leafy, self._sig(src)))
                 if self.window[0] <= i < self.window[1] and i not in self.uploads])
        self.captures += 1
        self.misses = 0
        self.state = _READY
        _held[:] = [r for r in _held if r() is not None]
        _held.append(weakref.ref(self))
        if len(_held) > MAX_GRAPHS:
            oldest = _held[0]()
            if oldest is not None:
                oldest._drop()
                oldest._reset()
                oldest.state = _OBSERVE
        bump("cuda_graph_captures")
        return self._finish(last, r1, r2, have, src, devices)

    def _exclude(self, s: int, why: str) -> None:
        """Take the window's instructions that read slot ``s`` out of it (as if their parameters
        varied: they run plainly before or after it) and choose the window again."""
        first, mid, last = self.parts
        for i in mid.at:
            used: list[int] = []
            _slots(self.instrs[i].leaves, used)
            if s in used:
                self.varying.add(i)
        logger.debug("genie: CUDA graph window narrowed (slot %d: %s)", s, why)
        self._drop()
        self.narrowed += 1
        if self.narrowed > MAX_NARROW:
            self.off(f"its window narrowed {MAX_NARROW} times")
            return
        self._plan()

    def _finish(self, last: _Part, r1: dict, r2: Any, have: dict, src: list,
                devices: list) -> Any:
        """The run's kept values once the window's are ``r2``: the suffix ``last`` run after
        them."""
        if type(r2) is tuple:
            return r2
        r3: Any = {}
        if last.program is not None:
            r3 = last.run({**have, **r2}, src, devices)
            if type(r3) is tuple:
                return r3
        got = {**have, **r2, **r3}
        return {k: got[k] for k in self.keep}

    # -- replay -------------------------------------------------------------------------------

    def _miss(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        bump("cuda_graph_misses")
        self.misses += 1
        if self.misses >= MAX_MISSES:
            self._drop()
            self._reset()
            self.state = _OBSERVE if self.captures < MAX_CAPTURES else _OFF
            if self.state == _OFF:
                self.off(f"{MAX_CAPTURES} graphs dropped after {MAX_MISSES} misses in a row")
        return self.native.run_plain(inputs, src, devices)

    def _replay(self, inputs: dict[int, Any], src: list, devices: list) -> Any:
        cap = self.cap
        leafy = self.leafy
        for k, x in cap.sig:
            i, p = leafy[k]
            y = src[i].leaves[p]
            if y is not x and not _same(x, y):
                return self._miss(inputs, src, devices)
        for s, v in cap.static.items():
            if _ident(inputs.get(s)) != v:
                return self._miss(inputs, src, devices)
        first, mid, last = self.parts
        r1 = first.run(inputs, src, devices) if first.program is not None else {}
        if type(r1) is tuple:
            return r1
        have = {**inputs, **r1}
        bufs = cap.bufs
        for s, b in bufs.items():
            t = have[s]
            if t.shape != b.shape or t.stride() != b.stride() or t.dtype != b.dtype:
                # (the prefix ran: the window runs plainly, and a narrower one is captured next)
                bump("cuda_graph_misses")
                self._exclude(s, "a moving input of another shape than the captured one")
                return self._finish(last, r1, mid.run(have, src, devices), have, src, devices)
        for s, b in bufs.items():
            b.copy_(have[s])
        out = cap.out
        if self.emulate:
            r = mid.program.run_plain({**{s: have[s] for s in cap.static}, **bufs}, self.graph,
                                      devices)
            if type(r) is tuple:
                return (mid.at[r[0]], r[1], have)
            for ss, _ in cap.pool:
                for s in ss:
                    out[s].copy_(r[s])
        else:
            self.graph.replay()
        for s in cap.back:
            have[s].copy_(bufs[s])
        r2 = dict(cap.alias)
        for ss, nbytes in cap.pool:
            t0 = out[ss[0]]
            mem = torch.empty(nbytes, dtype=torch.uint8, device=t0.device)
            mem.copy_(torch.empty(0, dtype=torch.uint8, device=t0.device).set_(
                t0.untyped_storage()))
            st = mem.untyped_storage()
            for s in ss:
                t = out[s]
                r2[s] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    st, t.storage_offset(), t.shape, t.stride())
        bump("cuda_graph_replays")
        return self._finish(last, r1, r2, have, src, devices)
