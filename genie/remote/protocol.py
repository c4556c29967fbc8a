"""The wire format between a Genie client and ``genie-server``: data only, never pickle.

A message is a ZeroMQ multipart message: one msgpack *header* frame, then raw tensor frames
(the bytes of CPU tensors, sent zero-copy). Every header is a map with ``t`` (its kind) and
``rid`` (a request id the reply repeats); the kinds are listed in :data:`REQUESTS`.

A tape travels in two parts, so that a program that repeats itself (a decode loop, a training
loop) pays for its structure once:

- the **skeleton**: ops by qualified name (``aten::add.Tensor``, resolved on the server against an
  allowlist), argument trees, slot wiring, frees, outputs and kept slots - everything but the
  constants. It is packed, hashed (BLAKE2b-128) and sent only when the server's session does not
  have it yet; the server compiles it once (resolves ops, checks every slot reference).
- the **constants**: one flat list per call - the handle id of every tape input, every constant
  leaf (numbers, dtypes, shapes of metadata-only arguments, host tensors as frame references) and
  the ``(seed, offset)`` of random ops. When the skeleton is known, only the positions that changed
  since its last call travel (``d``: a flat ``[pos, value, ...]`` list).

Values that are not plain msgpack types are msgpack extension types (``EXT_*``). Host tensors
travel as frames: contiguous bytes, or the raw span of a dense tensor with its strides.

Invariants: decoding never executes anything and never recurses: msgpack's decoder is iterative
with a fixed stack, an extension value's payload is decoded with no extension types inside it
(one level, whatever the message says), and byte, count and length limits are checked before
anything is allocated. Dtypes come from :data:`WIRE_DTYPES` (no quantized, bit or sub-byte
types), devices only as ``cpu``/``remote_accelerator``, layouts only strided; every size, index
and slot a message names is checked before use, and every string, device, dtype and layout an op
receives is checked against its schema (:func:`fill`); a malformed message raises
:class:`~genie.remote.ProtocolError`.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import operator
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgpack
import optree
import torch

from .. import _C, graphs
from ..config import config as _config
from ..graph import TensorMeta, same_const
from ..memory import fresh_bytes
from ..meta import policy
from ..planner import Instr, MetaArg, Slot, Tape, raw_instrs
from ..tape_io import (  # one table of names, shared
    _DTYPE_NAME,
    _DTYPES,
    _LAYOUTS,
    _MEMFMTS,
    UPLOAD,
    TapeDataError,
    op_from_name,
    op_to_name,
    spec_from_data,
    spec_to_data,
)
from . import ProtocolError, allowlist
from .decompose import for_server, served

PROTOCOL_VERSION = 1

#: request kinds: hello (open a session), run (a tape), get (download values), free (release
#: handles), ping (keep the lease; the reply says how busy the server is), bye (close the
#: session), send (push values to a peer server, :mod:`genie.remote.peer`), put (a peer's values
#: for a session, authorized by a ticket instead of the session token).
REQUESTS = frozenset({"hello", "run", "get", "free", "ping", "bye", "send", "put"})

#: Roles a residency hint may name (``ev`` in a run request: ``[handle id, code, ...]``), by
#: code; the code is also the eviction order (activations first, KV caches last). See
#: docs/deployment.md, "Residency under memory pressure".
ROLES = ("activation", "gradient", "input", "optimizer_state", "weight", "kv_cache")
ROLE_CODE = {r: i for i, r in enumerate(ROLES)}
#: roles a server never evicts while the session decodes (its last tape was a decode step)
DECODE_PINNED = frozenset({ROLE_CODE["weight"], ROLE_CODE["kv_cache"]})
#: the most hints one request may carry (pairs)
MAX_HINTS = 1 << 16

EXT_DTYPE, EXT_DEVICE, EXT_LAYOUT, EXT_MEMFMT, EXT_META, EXT_HOST, EXT_COMPLEX, EXT_INPUT, \
    EXT_SIZE = range(1, 10)

MAX_DIMS = 64
#: the largest header (msgpack frame) a server decodes; skeletons and constants travel in it
MAX_HEADER_BYTES = 16 << 20
#: the most elements one msgpack array or map of a header may declare (checked before the
#: decoder allocates it)
MAX_ITEMS = 1 << 20

#: Dtypes a message may name (frames, metadata, dtype arguments): dense numeric types. Quantized
#: types (a tensor without a quantizer crashes kernels), the ``bits*`` and sub-byte
#: ``uint1..7``/``int1..7``/``float4`` placeholders (no kernels) are refused.
WIRE_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.float8_e5m2, torch.float8_e4m3fn,
    torch.float8_e5m2fnuz, torch.float8_e4m3fnuz,
})

_DTYPE_EXT = {v: msgpack.ExtType(EXT_DTYPE, k.encode()) for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAME[dtype]


def dtype_of(name: Any) -> torch.dtype:
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise ProtocolError(f"unknown dtype {name!r:.40}")
    if d not in WIRE_DTYPES:
        raise ProtocolError(f"dtype {d} cannot be sent to a server (quantized, bit and "
                            "sub-byte dtypes are refused); convert the tensor first")
    return d


# --- msgpack ----------------------------------------------------------------------------------

def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any, limit: int = MAX_HEADER_BYTES) -> Any:
    """Unpack a header with extension types decoded; ProtocolError if bad.

    Bounded: ``limit`` bytes, :data:`MAX_ITEMS` elements per array or map (checked by msgpack
    before it allocates), no recursion (see :func:`_ext_hook`).
    """
    return _unpack(data, limit, _ext_hook)


def _unpack(data: Any, limit: int, hook: Any) -> Any:
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n > limit:
        raise ProtocolError(f"header of {n} bytes exceeds the {limit}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=hook,
                               max_str_len=n, max_bin_len=n, max_ext_len=n,
                               max_array_len=min(n, MAX_ITEMS), max_map_len=min(n, MAX_ITEMS))
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable msgpack ({type(e).__name__}: {e})") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"an extension value (type {code}) nested inside another; the "
                        "wire format never nests them")


@dataclass(frozen=True, slots=True)
class FrameRef:
    """A host tensor constant: data in frame ``index``, laid out as ``shape``/``stride``."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class InputUpload:
    """A tape input whose value is on the client only: upload it and keep it as handle ``hid``."""

    ref: FrameRef
    hid: int


def _ints(x: Any, what: str, lo: int = 0, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(x, list) or (n is not None and len(x) != n) or len(x) > MAX_DIMS or \
            not all(type(i) is int and i >= lo for i in x):
        raise ProtocolError(f"bad {what}: {x!r}")
    return tuple(x)


def _frame_ref(v: Any) -> FrameRef:
    if not isinstance(v, list) or len(v) != 4 or type(v[0]) is not int or v[0] < 0:
        raise ProtocolError(f"bad tensor reference {v!r}")
    shape = _ints(v[2], "shape")
    stride = None if v[3] is None else _ints(v[3], "stride", n=len(shape))
    return FrameRef(v[0], dtype_of(v[1]), shape, stride)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_DTYPE:
        return dtype_of(data.decode("ascii", "replace"))
    if code == EXT_DEVICE:
        s = data.decode("ascii", "replace")
        if not re.fullmatch(r"(remote_accelerator|cpu)(:\d{1,4})?", s):
            raise ProtocolError(f"device {s!r} is not allowed in a tape")
        return torch.device(s)
    if code == EXT_LAYOUT or code == EXT_MEMFMT:
        table = _LAYOUTS if code == EXT_LAYOUT else _MEMFMTS
        v = table.get(data.decode("ascii", "replace"))
        if v is None:
            raise ProtocolError(f"unknown layout/memory format {data[:40]!r}")
        if code == EXT_LAYOUT and v is not torch.strided:
            raise ProtocolError(f"layout {v} is not served (remote tensors are dense and "
                                "strided); convert to a dense tensor first")
        return v
    v = _unpack(data, MAX_HEADER_BYTES, _no_ext)  # one level: payloads hold no extensions
    if code == EXT_META:
        if not isinstance(v, list) or len(v) != 4 or type(v[2]) is not int or v[2] < 0:
            raise ProtocolError(f"bad metadata argument {v!r:.80}")
        shape = _ints(v[0], "shape")
        return MetaArg(TensorMeta(shape, _ints(v[1], "stride", n=len(shape)), v[2],
                                  dtype_of(v[3]), 0))
    if code == EXT_HOST:
        return _frame_ref(v)
    if code == EXT_INPUT:
        if not isinstance(v, list) or len(v) != 2 or type(v[1]) is not int or v[1] < 0:
            raise ProtocolError(f"bad input upload {v!r}")
        return InputUpload(_frame_ref(v[0]), v[1])
    if code == EXT_COMPLEX:
        if not isinstance(v, list) or len(v) != 2 or not all(type(x) is float for x in v):
            raise ProtocolError(f"bad complex {v!r}")
        return complex(v[0], v[1])
    if code == EXT_SIZE:
        return torch.Size(_ints(v, "size"))
    raise ProtocolError(f"unknown extension type {code}")


def meta_arg_nbytes(m: TensorMeta) -> int:
    """Bytes of the storage a metadata-only argument stands for (ProtocolError if its strides
    are negative)."""
    if any(st < 0 for st in m.stride) or m.offset < 0:
        raise ProtocolError(f"metadata argument with negative strides {list(m.stride)}")
    if any(s == 0 for s in m.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride, strict=True))) * \
        m.dtype.itemsize


# --- tensors <-> frames -----------------------------------------------------------------------

def tensor_frame(t: torch.Tensor) -> tuple[Any, list[Any]]:
    """(buffer, [dtype, shape, stride or None]) of a tensor; dense layouts keep their strides."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    shape = list(t.shape)
    stride: list[int] | None = None
    if not t.is_contiguous():
        from torch._prims_common import is_non_overlapping_and_dense_or_false

        if is_non_overlapping_and_dense_or_false(t) and min(t.stride(), default=0) >= 0:
            stride = list(t.stride())
            t = t.as_strided((t.numel(),), (1,), t.storage_offset())
        else:
            t = t.contiguous()
    n = t.numel()
    # t is contiguous here; a size-1 dimension may still have any stride (a diagonal of one
    # element), so flatten by its layout, not by reshape (which keeps that stride)
    buf = t.as_strided((n,), (1,), t.storage_offset()).view(torch.uint8).numpy() if n else b""
    return buf, [dtype_name(t.dtype), shape, stride]


def tensor_frames(vals: list[torch.Tensor]) -> tuple[list[list[Any]], list[Any]]:
    """(metas, buffers) of :func:`tensor_frame` for each of ``vals``: in one native pass when
    every value is a contiguous CPU tensor (``genie._C._frames_of``: a worker's reply after a
    replay runs with cold caches, where tensor_frame's tensor calls cost ~100 µs a value), else
    one by one."""
    got = _C._frames_of(vals, _DTYPE_NAME)
    if got is not None:
        return got
    metas, bufs = [], []
    for v in vals:
        buf, meta = tensor_frame(v)
        metas.append(meta)
        bufs.append(buf)
    return metas, bufs


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


#: frames up to this size that :func:`frame_tensor` copies go straight into a fresh tensor
SMALL_COPY = 1 << 16


def check_bounds(shape: Any, stride: Any, offset: int, itemsize: int, have: int) -> str | None:
    """Why a tensor of this layout addresses memory outside ``have`` storage bytes (None when
    it does not)."""
    if any(s == 0 for s in shape):
        return None
    if any(st < 0 for st in stride) or offset < 0:
        return f"negative strides {list(stride)} or offset {offset}"
    need = (offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * itemsize
    if need > have:
        return (f"a view of shape {list(shape)}, strides {list(stride)}, offset {offset} "
                f"reaches byte {need} of a storage of {have} bytes")
    return None


def frame_tensor(buf: Any, ref: FrameRef, copy: bool) -> torch.Tensor:
    """The tensor a frame holds (checked against ``ref``); ``copy`` gives it its own memory."""
    n = math.prod(ref.shape)
    size = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if size != n * ref.dtype.itemsize:
        raise ProtocolError(f"tensor frame {ref.index} has {size} bytes; "
                            f"{ref.dtype}{list(ref.shape)} needs {n * ref.dtype.itemsize}")
    if ref.stride is not None:
        # the frame is the raw span of a dense tensor: the strides must address exactly n elements
        span = 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride, strict=True)) \
            if n else 0
        if span != n:
            raise ProtocolError(f"strides {list(ref.stride)} do not describe a dense layout "
                                f"of {list(ref.shape)}")
    if n == 0:
        return torch.empty(ref.shape, dtype=ref.dtype)
    if copy and size <= SMALL_COPY:
        # a scalar read: the bytes cloned, as bytes, into fresh aligned memory of the allocator
        # (torch alone: a client reads one after every wait on the server, when numpy's path
        # was no longer in the caches, ~20 us more a read on a loaded machine)
        # (as the dtype at once, no view of a shape that is already the flat one: a scalar
        # read is three torch calls, each ~5-10 us with those caches cold)
        flat = torch.frombuffer(bytearray(buf), dtype=ref.dtype).clone()
        if ref.stride is not None:
            return flat.as_strided(ref.shape, ref.stride)
        return flat if len(ref.shape) == 1 else flat.view(ref.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: we copy or only read
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    if raw.data_ptr() % ALIGN:
        # ZeroMQ places frames at any offset (8 mod 16 is common): kernels assume their dtype's
        # alignment (a complex128 copy from 8 mod 16 crashes), so the bytes move first, as bytes
        raw = raw.clone()
        copy = False
    flat = raw.view(ref.dtype)
    t = flat.view(ref.shape) if ref.stride is None else flat.as_strided(ref.shape, ref.stride)
    return t.clone(memory_format=torch.preserve_format) if copy else t


def read_into(buf: Any, dtype: torch.dtype, shape: list[int], stride: list[int] | None
              ) -> torch.Tensor:
    """A fresh, writable tensor with the frame's bytes (one copy)."""
    ref = FrameRef(0, dtype, tuple(shape), None if stride is None else tuple(stride))
    return frame_tensor(buf, ref, copy=True)


# --- chunks -----------------------------------------------------------------------------------

#: frames larger than this travel as chunks of this size (header ``fc``: the number of chunks of
#: each frame). Chunks are views of the sender's memory; the receiver joins them into one buffer
#: of its own, aligned as its allocator aligns tensors (frames ZeroMQ receives are not), with
#: ZeroMQ's chunk buffers reused meanwhile: about as fast as using one large received frame in
#: place, and much faster under CURVE, which encrypts each message whole.
CHUNK = 1 << 20
#: the alignment of torch's CPU allocations: a kernel given an input at another alignment may
#: round differently (a matrix-vector product does), so values are never left on a misaligned
#: received frame
ALIGN = 64


def frame_view(f: Any) -> memoryview:
    """The bytes of a frame (a ``zmq.Frame``, bytes, an array) as a flat memoryview."""
    b = getattr(f, "buffer", f)  # a zmq.Frame's bytes, or the object itself
    return (b if isinstance(b, memoryview) else memoryview(b)).cast("B")


def split_frames(frames: Any) -> tuple[list[Any], list[int] | None]:
    """``(wire frames, chunk counts)``: frames over :data:`CHUNK` bytes split into views of
    their memory (no copy); counts None when nothing was split."""
    frames = list(frames)
    if all(frame_view(f).nbytes <= CHUNK for f in frames):
        return frames, None
    out: list[Any] = []
    counts: list[int] = []
    for f in frames:
        m = frame_view(f)
        if m.nbytes <= CHUNK:
            out.append(f)
            counts.append(1)
        else:
            out.extend(m[i:i + CHUNK] for i in range(0, m.nbytes, CHUNK))
            counts.append(-(-m.nbytes // CHUNK))
    return out, counts


def join_frames(frames: list[Any], counts: Any) -> list[Any]:
    """The frames :func:`split_frames` split, each joined into one aligned buffer of its own
    (one copy of its chunks); ProtocolError when ``counts`` does not describe ``frames``."""
    if counts is None:
        return frames
    if not isinstance(counts, list) or not all(type(c) is int and c >= 1 for c in counts) or \
            sum(counts) != len(frames):
        raise ProtocolError(f"bad frame chunk counts for {len(frames)} frames")
    out: list[Any] = []
    k = 0
    for c in counts:
        if c == 1:
            out.append(frames[k])
        else:
            parts = [frame_view(f) for f in frames[k:k + c]]
            joined = fresh_bytes(sum(p.nbytes for p in parts))  # written whole, at once
            o = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only chunks: only read
                for p in parts:
                    if p.nbytes:
                        joined[o:o + p.nbytes].copy_(torch.frombuffer(p, dtype=torch.uint8))
                        o += p.nbytes
            out.append(joined.numpy())
        k += c
    return out


# --- constants --------------------------------------------------------------------------------

class Unsendable(TypeError):
    """A tape constant that the wire format cannot carry."""


#: the integers a constant may be (msgpack's: int64 and uint64)
_INT_LO, _INT_HI = -(1 << 63), 1 << 64


def const_data(x: Any, frames: list[Any]) -> Any:
    """A tape constant as msgpack data; host tensors append a frame."""
    t = type(x)
    if x is None or t is bool or t is str or t is float:
        return x
    if t is int:
        if not _INT_LO <= x < _INT_HI:
            raise Unsendable(f"integer constant {x} does not fit in 64 bits")
        return x
    if t is torch.dtype:
        return _DTYPE_EXT[x]
    if t is MetaArg:
        m = x.meta
        return msgpack.ExtType(EXT_META, pack([list(m.shape), list(m.stride), m.offset,
                                               _DTYPE_NAME[m.dtype]]))
    if isinstance(x, torch.Tensor):
        return msgpack.ExtType(EXT_HOST, pack(host_ref(x, frames)))
    if t is torch.device:
        return msgpack.ExtType(EXT_DEVICE, str(x).encode())
    if t is torch.Size:
        return msgpack.ExtType(EXT_SIZE, pack(list(x)))
    if t is complex:
        return msgpack.ExtType(EXT_COMPLEX, pack([x.real, x.imag]))
    if t is torch.layout:
        return msgpack.ExtType(EXT_LAYOUT, str(x).removeprefix("torch.").encode())
    if t is torch.memory_format:
        return msgpack.ExtType(EXT_MEMFMT, str(x).removeprefix("torch.").encode())
    raise Unsendable(f"a constant of type {t.__name__} ({x!r:.60}) cannot be sent to a server")


def host_ref(x: torch.Tensor, frames: list[Any]) -> list[Any]:
    buf, (dt, shape, stride) = tensor_frame(x)
    frames.append(buf)
    return [len(frames) - 1, dt, shape, stride]


# --- skeletons (client side) ------------------------------------------------------------------

@dataclass(slots=True)
class Encoded:
    """A tape for the wire: skeleton (bytes + key), constants, frames, inputs by slot."""

    key: bytes
    skeleton: bytes
    consts: list[Any]
    frames: list[Any]
    #: the kept slots the server makes (not inputs), in the order it numbers their handles
    #: (``id0``, ``id0 + 1``, ...)
    order: list[int] = field(default_factory=list)
    #: slots of upload instructions sent as input uploads (``hoist``)
    hoisted: frozenset[int] = frozenset()


def _spec_data(spec: Any) -> Any:
    try:
        return spec_to_data(spec)
    except TypeError as e:
        raise Unsendable(str(e)) from None


def encode_tape(tape: Tape, input_const: Any, hoist: bool = False) -> Encoded:
    """Split ``tape`` into skeleton and constants; ``input_const(slot, value, frames)`` gives the
    constant that names each tape input (a handle id or an :class:`InputUpload` extension).

    An op the server does not run is sent as its decomposition (:mod:`.decompose`): checked once
    per distinct op of the tape, so a tape of served ops pays nothing more.

    ``hoist``: the uploads the tape keeps go as input uploads (``input_const`` of their slot
    and host tensor), and slots are numbered in order of first use, so that a tape whose values
    are uploaded with it (a model's first call) has the skeleton of the same tape once they
    are resident (its second call): :attr:`Encoded.hoisted`, :attr:`Encoded.order`.
    """
    frames: list[Any] = []
    plan = tape.plan
    # a tape instantiated from a plan (genie.plan_cache) has the plan's structure: its encoding
    # is the plan's (the plan-cache match checked every op, tree, wiring and kind of constant),
    # so a steady step pays no structure key (~0.5 ms for a 225-instruction GPT-2 token). Not a
    # tape a pass rewrote (its ``plan`` is the pass's shadow of the plan, without instructions)
    tmpl = getattr(plan, "instrs", None)
    if tmpl is None:
        plan = None
    # (one encoding per plan and number of outputs: a plan's tape sent ahead downloads none,
    # genie.backends.remote.send_ahead, and its skeleton says so)
    wkey = _WIRE if tape.outputs else _WIRE_KEPT
    pw: _PlanWire | None = plan.artifacts.get(wkey) if plan is not None else None
    if pw is not None and pw.wire.hoist == hoist:
        # the plan's own instructions: their constants as the plan sent them. A hit whose
        # instructions are not built (Tape.instrs) is read where a native replay reads it: the
        # plan's instruction where the step's is the plan's own, else its node, whose leaves
        # and (seed, offset) hold what the rebuilt instruction would (Plan.replay_source), so
        # the build is skipped (~25 us a GPT-2 4x128 token)
        wire = pw.wire
        stale = tape._stale
        # (a hit whose run released its nodes: Tape.instrs raises what happened)
        src = tape.instrs if stale is None or (tape.nodes and tape.nodes[-1] is None) else \
            plan.replay_source(raw_instrs(tape), tape.nodes, stale)
        consts = _input_consts(tape, wire, input_const, frames, src)
        where = wire.where
        part = pw.consts.copy()
        starts = pw.starts
        seen = pw.seen
        gets = pw.gets
        # the entries whose source is not the plan's own object; natively, those whose values
        # are the last call's are placed at once and only the others come back (csrc/wire.cpp)
        todo = _wire_same(src, pw.at, pw.own, gets, seen, starts, part) \
            if _config.native_wire else \
            itertools.compress(range(len(where)),
                               map(operator.is_not, map(src.__getitem__, pw.at), pw.own))
        for w in todo:
            i, js = where[w]
            ins = src[i]
            last = seen[w]
            if last is _MOVES:
                vals = _leaf_consts(ins, js, frames)
            else:
                # the values at the entry's leaves (a node's other leaves are references): one
                # value, or a tuple of several
                now = gets[w](ins.leaves)
                fl = last[2] if last is not None else None
                if last is None:  # first seen: kept for the next call where it may be
                    nf = len(frames)
                    vals = _leaf_consts(ins, js, frames)
                    vs = now if len(js) > 1 else (now,)
                    fl = -1 if len(js) == 1 and type(now) is float else \
                        tuple(k for k, x in enumerate(vs) if type(x) is float) or None
                    seen[w] = (now, vals, fl, 0) if len(frames) == nf and \
                        not any(isinstance(x, torch.Tensor) for x in vs) else _MOVES
                elif last[0] == now and (fl is None or (
                        same_const(last[0], now) if fl == -1 else
                        all(map(same_const, map(last[0].__getitem__, fl),
                                map(now.__getitem__, fl))))):
                    vals = last[1]  # this call's constants are the last call's
                else:  # (floats compared as constants: == takes -0.0 for 0.0)
                    vals = _leaf_consts(ins, js, frames)
                    # the second change: its constants move every call
                    seen[w] = (now, vals, fl, 1) if not last[3] else _MOVES
            part[starts[w]:starts[w] + len(js)] = vals
        consts += part
        return Encoded(wire.key, wire.skeleton, consts, frames, wire.order, wire.hoisted)
    instrs = tape.instrs
    inputs = sorted(tape.inputs)
    shape = (hoist, _structure(tape, inputs))
    with _encoded_lock:  # clients of several servers may encode at once (threads)
        memo: _Wire | None = _encoded.get(shape)
        if memo is not None:
            _encoded.move_to_end(shape)
    if memo is not None:  # a structure encoded before: only its constants are new
        consts = _input_consts(tape, memo, input_const, frames)
        n_consts = len(consts)
        own: list[Any] = []
        starts = []
        for i, js in memo.where:
            ins = instrs[i]
            nf = len(frames)
            starts.append(len(consts) - n_consts)
            consts += _leaf_consts(ins, js, frames)
            # constants every call of the plan shares: no random seed, no host tensor
            own.append(ins if tmpl is not None and ins is tmpl[i] and ins.rng is None and
                       len(frames) == nf else None)
        if plan is not None:
            plan.artifacts[wkey] = _PlanWire(
                memo, [i for i, _ in memo.where], own, consts[n_consts:], starts,
                [None if js[-1] >= 0 else _MOVES for _, js in memo.where],
                [operator.itemgetter(*js) for _, js in memo.where])
        return Encoded(memo.key, memo.skeleton, consts, frames, memo.order, memo.hoisted)
    keep = tape.keep
    # uploads of kept values: sent as input uploads (their instruction index by slot)
    up = {ins.outs[0]: i for i, ins in enumerate(instrs)
          if ins.op == UPLOAD and len(ins.outs) == 1 and ins.outs[0] in keep and
          len(ins.leaves) == 1 and isinstance(ins.leaves[0], torch.Tensor) and
          ins.rng is None and not ins.free} if hoist else {}
    while True:
        skip = set(up.values())
        where: list[tuple[int, int]] = []
        ops: dict[str, int] = {}
        specs: dict[Any, int] = {}
        spec_list: list[Any] = []
        rows: list[Any] = []
        # wire slot numbers: the tape's, or (hoist) in order of first use
        num: dict[int, int] | None = {} if hoist else None
        for i, ins in enumerate(instrs):
            if i in skip:
                continue  # an input upload
            try:
                name = op_to_name(ins.op)
            except TypeError as e:
                raise Unsendable(str(e)) from None
            oi = ops.get(name)
            if oi is None:
                if instrs is tape.instrs and not served(ins.op):
                    break  # decompose, then encode again
                oi = ops[name] = len(ops)
            if ins.spec is None:
                si = -1
            else:
                si = specs.get(ins.spec)
                if si is None:
                    si = specs[ins.spec] = len(spec_list)
                    spec_list.append(_spec_data(ins.spec))
            code = []
            for j, x in enumerate(ins.leaves):
                if type(x) is Slot:
                    code.append(x.id if num is None else num.setdefault(x.id, len(num)))
                else:
                    code.append(-1)
                    where.append((i, j))
            if ins.rng is not None:
                where += ((i, -1), (i, -2))
            outs = list(ins.outs) if num is None else \
                [None if s is None else num.setdefault(s, len(num)) for s in ins.outs]
            free = list(ins.free) if num is None else \
                [num.setdefault(s, len(num)) for s in ins.free]
            rows.append([oi, si, code, outs, free, ins.rng is not None])
        else:
            break
        instrs = for_server(tape)
        up = {}
    ins_of = {s: -1 for s in inputs}
    ins_of.update(up)
    if num is None:
        num = {s: s for s in {*ins_of, *tape.outputs, *keep}}
    for s in sorted({*ins_of, *tape.outputs, *keep}):  # values no instruction reads
        num.setdefault(s, len(num))
    wire_in = sorted(ins_of, key=num.__getitem__)
    # the server keeps an input upload under its own id: not a kept slot of the skeleton
    wire_keep = sorted((s for s in keep if s not in up), key=num.__getitem__)
    order = [s for s in wire_keep if s not in ins_of]
    skel = pack([PROTOCOL_VERSION, list(ops), spec_list, rows, [num[s] for s in wire_in],
                 [num[s] for s in tape.outputs], [num[s] for s in wire_keep]])
    key = hashlib.blake2b(skel, digest_size=16).digest()
    grouped: dict[int, list[int]] = {}
    for i, j in where:
        grouped.setdefault(i, []).append(j)
    wire = _Wire(key, skel, list(grouped.items()), [(s, ins_of[s]) for s in wire_in], order,
                 frozenset(up), hoist)
    consts = _input_consts(tape, wire, input_const, frames)
    for i, js in wire.where:
        consts += _leaf_consts(instrs[i], js, frames)
    if instrs is tape.instrs:  # a decomposition may depend on the constants: not memoized
        with _encoded_lock:
            if len(_encoded) >= ENCODED_MEMORY:
                _encoded.popitem(last=False)
            _encoded[shape] = wire
    return Encoded(key, skel, consts, frames, order, wire.hoisted)


def _leaf_consts(ins: Instr, js: list[int], frames: list[Any]) -> list[Any]:
    """The constants of ``ins`` at leaves ``js`` (negative: its random seed, offset)."""
    leaves = ins.leaves
    out = []
    for j in js:  # (a loop, ints inline: half the time of a comprehension of calls)
        if j >= 0:
            x = leaves[j]
            out.append(x if type(x) is int and _INT_LO <= x < _INT_HI else const_data(x, frames))
        else:
            out.append(int(ins.rng[-1 - j]))
    return out


def _input_consts(tape: Tape, wire: _Wire, input_const: Any, frames: list[Any],
                  instrs: list[Any] | None = None) -> list[Any]:
    """The constants naming ``tape``'s inputs in the wire's order (input uploads: the host
    tensor of their upload instruction, or ``instrs``' there: its node)."""
    given = tape.inputs
    if instrs is None:
        instrs = tape.instrs
    return [input_const(s, given[s] if i < 0 else instrs[i].leaves[0], frames)
            for s, i in wire.inputs]


@dataclass(slots=True)
class _Wire:
    """A structure's encoding: skeleton, key and where its constants are (instruction index,
    leaf indices; a negative leaf is a random seed or offset)."""

    key: bytes
    skeleton: bytes
    where: list[tuple[int, list[int]]]
    #: the inputs in wire order: (slot, -1) for a tape input, (slot, instruction index) for an
    #: upload sent as an input upload
    inputs: list[tuple[int, int]]
    order: list[int]
    hoisted: frozenset[int]
    hoist: bool


@dataclass(slots=True)
class _PlanWire:
    """A structure's encoding as one plan fills it: per entry of ``wire.where``, its instruction
    index (``at``), the plan's instruction object when its constants are the same every call
    (``own``; None: rebuilt every call, a random op or one with a host tensor) and where its
    constants start in ``consts`` (``starts``), the constants of those entries as first sent.
    A plan-cache hit reuses the plan's object for an instruction whose constants are the
    plan's, so a call re-encodes only the entries whose instruction (or node: a hit's
    instructions are not built) is not that object, and of those (``seen``: per entry, the
    values at its leaves of its last encoding, their constants, the positions of floats among
    them and whether they changed before; :data:`_MOVES` where they keep changing) only the
    ones whose values differ from the last call's: a shape-
    generic plan rebuilds every instruction of a shape that moves (a GPT-2 token's growing KV
    cache: 39 of a 4x128 token's instructions, nearly all of the same constants as the token
    before)."""

    wire: _Wire
    at: list[int]
    own: list[Any]
    consts: list[Any]
    starts: list[int]
    seen: list[Any]
    #: per entry, what reads the values at its leaves from an instruction's (or node's) leaves
    gets: list[Any]


#: the native loop over a plan's wire (csrc/wire.cpp; GENIE_NATIVE_WIRE=0: the Python loop)
_wire_same = _C._wire_same
_native_delta = _C._const_delta

#: ``_PlanWire.seen`` of an entry encoded every call: a random op, a host tensor, or constants
#: that changed twice (an optimizer's step-dependent floats, a length that grows every token)
_MOVES = ()

#: where a plan keeps its encoding (:attr:`genie.plan_cache.Plan.artifacts`)
_WIRE = "wire"
_WIRE_KEPT = "wire.kept"  # the same plan's tape with every output kept, none downloaded
#: skeletons encoded by :func:`encode_tape`, by tape structure (least recently used dropped)
_encoded: collections.OrderedDict[Any, _Wire] = collections.OrderedDict()
ENCODED_MEMORY = 512
_encoded_lock = threading.Lock()


def _structure(tape: Tape, inputs: list[int]) -> Any:
    """What a skeleton is made of (ops, argument trees, which leaves are which slots, outputs,
    frees, random or not; the tape's inputs, outputs and kept slots): equal structures encode to
    the same skeleton, whatever their constants."""
    return (tuple(inputs), tuple(tape.outputs), tuple(sorted(tape.keep)),
            tuple([(ins.op, ins.spec, ins.outs, ins.free, ins.rng is None,
                    tuple([x.id if type(x) is Slot else -1 for x in ins.leaves]))
                   for ins in tape.instrs]))


def const_delta(old: list[Any], new: list[Any]) -> list[Any] | None:
    """``[pos, value, ...]`` for the positions that differ, or None when sending all is cheaper.
    Natively (``genie._C._const_delta``, the loop below: ~400 constants a GPT-2 4x128 token)
    unless ``GENIE_NATIVE_WIRE=0``."""
    if _config.native_wire:
        return _native_delta(old, new, same_const)
    if len(old) != len(new):
        return None
    d: list[Any] = []
    # the same object is the same constant (a plan's shared constants are): compared at C speed
    for i in itertools.compress(range(len(new)), map(operator.is_not, old, new)):
        a, b = old[i], new[i]
        if type(a) is int and type(b) is int and a == b:  # (same_const's answer, sooner)
            continue
        if not same_const(a, b):
            d.append(i)
            d.append(b)
    return d if len(d) < len(new) else None


# --- skeletons (server side) ------------------------------------------------------------------

def resolve_op(name: Any) -> Any:
    """The op a qualified name means, if the server's allowlist admits it
    (:mod:`genie.remote.allowlist`)."""
    if name != UPLOAD and isinstance(name, str) and not allowlist.admitted(name):
        raise ProtocolError(f"op {name[:120]!r} does not run on a Genie server: "
                            f"{allowlist.why_refused(name)}. Compute it on the client (or "
                            "use an admitted op: genie/remote/allowlist.txt)")
    try:
        return op_from_name(name)
    except TapeDataError as e:
        raise ProtocolError(str(e)) from None


#: schema types whose values fill checks: devices, dtypes, layouts, memory formats, strings,
#: generators (the Python binding would otherwise convert a string to a device, or an int to a
#: quantized dtype)
_CHECKED_TYPES = {
    "Device": "device", "Optional[Device]": "device", "ScalarType": "dtype",
    "Optional[ScalarType]": "dtype", "Layout": "layout", "Optional[Layout]": "layout",
    "MemoryFormat": "memfmt", "Optional[MemoryFormat]": "memfmt", "str": "str",
    "Optional[str]": "str", "Optional[Generator]": "none",
}


@dataclass(frozen=True, slots=True)
class ArgCheck:
    """One argument of an op whose value :func:`fill` checks (see :data:`_CHECKED_TYPES`)."""

    pos: int  # schema position (for positional arguments)
    name: str
    kind: str


#: list arguments of a ``_foreach_`` op, which must all have one length (the foreach contract;
#: ``_foreach_copy``'s kernel read past a shorter list: found by the per-op fuzzer)
_FOREACH_LISTS = frozenset({"List[Tensor]", "List[number]", "List[float]",
                            "List[Optional[Tensor]]"})


def arg_checks(op: Any) -> tuple[ArgCheck, ...]:
    foreach = op._schema.name.startswith("aten::_foreach_") or \
        op._schema.name.startswith("aten::_amp_foreach_")
    return tuple(ArgCheck(i, a.name, _CHECKED_TYPES[str(a.real_type)]
                          if str(a.real_type) in _CHECKED_TYPES else "list")
                 for i, a in enumerate(op._schema.arguments)
                 if str(a.real_type) in _CHECKED_TYPES or
                 (foreach and str(a.real_type) in _FOREACH_LISTS))


def check_args(op: Any, checks: tuple[ArgCheck, ...], args: Any, kwargs: Any, i: int) -> None:
    """Refuse values of device, dtype, layout, memory-format, string and generator arguments
    that are not what the schema means (ProtocolError naming the op and argument)."""
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ProtocolError(f"instruction {i}: arguments must be a (tuple, dict) tree")
    names = {a.name for a in op._schema.arguments}
    for k in kwargs:
        if k not in names:
            raise ProtocolError(f"instruction {i}: {op} has no argument {k!r:.40}")
    lengths: dict[str, int] = {}
    for c in checks:
        v = args[c.pos] if c.pos < len(args) else kwargs.get(c.name)
        if v is None:
            continue
        k = c.kind
        if k == "list":
            lengths[c.name] = len(v) if isinstance(v, (list, tuple)) else -1
            if len(set(lengths.values())) > 1:
                raise ProtocolError(
                    f"instruction {i}: the lists of {op} must have one length (tensor lists "
                    f"must have the same number of tensors); got {lengths}")
            continue
        ok = ((k == "device" and type(v) is torch.device) or
              (k == "dtype" and type(v) is torch.dtype and v in WIRE_DTYPES) or
              (k == "layout" and v is torch.strided) or
              (k == "memfmt" and type(v) is torch.memory_format) or
              (k == "str" and type(v) is str and v in allowlist.STR_ENUMS.get(c.name, ())) or
              (k == "str" and op in _GRAPH_OPS and c.name == "key" and graphs.is_key(v)))
        if not ok:
            want = {"device": "a device constant (cpu or remote_accelerator)",
                    "dtype": "a dense dtype", "layout": "torch.strided",
                    "memfmt": "a memory format", "none": "None (no generators on a server)",
                    "str": f"one of {sorted(allowlist.STR_ENUMS.get(c.name, ()))}"}[k]
            raise ProtocolError(f"instruction {i}: argument {c.name!r} of {op} must be "
                                f"{want}; got {v!r:.40}")


_GRAPH_OPS = (graphs.GRAPH_OP, graphs.GRAPH_MUT_OP)


def _written_slots(spec: Any, leaves: list[Any], i: int) -> None:
    """A ``genie::graph_mut`` instruction writes the tensors of its ``written`` list: each must
    be a value of the session (a slot: a handle, an upload, a value the tape computed), never a
    constant of the request (a host tensor, a metadata-only argument), as a list of its own."""
    args, kwargs = optree.tree_unflatten(spec, list(range(spec.num_leaves)))
    names = [a.name for a in graphs.GRAPH_MUT_OP._schema.arguments]
    w = {**dict(zip(names, args)), **kwargs}.get("written")
    if not isinstance(w, list) or not all(type(j) is int and leaves[j] is not None for j in w):
        raise ProtocolError(f"instruction {i}: the tensors genie::graph_mut writes must be a "
                            "list of the session's values (slots), not constants of the request")


def _spec(d: Any) -> Any:
    try:
        return spec_from_data(d)
    except TapeDataError as e:
        raise ProtocolError(str(e)) from None


@dataclass(slots=True)
class Template:
    op: Any
    spec: Any
    leaves: list[Any]  # Slot, or None for "the next constant"
    outs: tuple[int | None, ...]
    free: tuple[int, ...]
    rng: bool
    checks: tuple[ArgCheck, ...]  # arguments whose values fill checks against the schema


@dataclass(slots=True)
class Compiled:
    """A checked skeleton: run it by filling in constants (:func:`fill`)."""

    templates: list[Template]
    inputs: list[int]
    outputs: list[int]
    keep: list[int]
    n_consts: int
    made: list[int]  # the kept slots that are not inputs (the values a run adds, in order)
    uploads: bool  # whether an instruction uploads (its value becomes an input of the tape)
    consts: list[Any] | None = None  # the last call's constants (base of the next delta)
    #: the last :func:`fill`'s instructions and where each constant went (see :func:`refill`)
    filled: Filled | None = None
    #: whether an instruction's op writes an argument (its schema says ``Tensor(a!)``): only
    #: those can resize a tensor the tape reads (``resize_``, ``out=``, ``set_``)
    writes: bool = True
    #: whether an instruction calls a compiled graph (``genie::graph``, ``genie::graph_mut``):
    #: only then does a run look for the graph keys its tape calls
    graph_calls: bool = True
    #: the worker's native lane of this skeleton (``genie._C._WorkerLane``: its steady requests
    #: in one native call, :meth:`genie.remote.worker.Worker._run_lane`), False when it is not
    #: built again, and the requests it passed to the Python path in a row
    lane: Any = None
    lane_misses: int = 0
    lane_pkey: Any = None  # (its program's key: the worker's early-reply split)
    #: what the lane was built from: the last fill's constant places and class key parts
    lane_state: Any = None
    lane_kinds: Any = None  # (the fill's constant places, int places, what each is)


@dataclass(slots=True)
class Filled:
    """A filled tape's instructions, kept to be patched by the next call's changed constants.

    ``where[k]`` is ``(instruction, leaf)`` of constant ``k`` (leaf -1/-2: the random seed /
    offset; instruction -1: an upload); ``frames`` lists the constants that are host tensors
    and ``uploads`` the upload instructions' ``(constant, slot)``: both read from every call's
    own frames."""

    instrs: list[Instr]
    where: dict[int, tuple[int, int]]
    frames: list[int]
    uploads: list[tuple[int, int]] = field(default_factory=list)
    #: leaves patched ``(instruction, leaf)`` since ``params`` was found
    patched: list[tuple[int, int]] = field(default_factory=list)
    #: what :func:`genie.remote.shape_class.shape_params` found in these instructions
    params: Any = None


def _is_call_tree(spec: Any) -> bool:
    """Whether an argument tree is ``(args tuple, kwargs dict)``, as every op call's is."""
    tree = optree.tree_unflatten(spec, [None] * spec.num_leaves)
    return type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and \
        type(tree[1]) is dict


def _slot_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(type(s) is int and 0 <= s < (1 << 31) for s in x):
        raise ProtocolError(f"bad {what} slot list")
    return x


#: the most instructions one skeleton may hold (bounds the time a compile takes, ~20 us each)
MAX_INSTRS = 1 << 18


def compile_skeleton(data: bytes, max_instrs: int = MAX_INSTRS) -> Compiled:
    """Check a skeleton and resolve its ops and argument trees (ProtocolError when malformed)."""
    sk = unpack(data)
    if not isinstance(sk, list) or len(sk) != 7 or sk[0] != PROTOCOL_VERSION:
        raise ProtocolError("bad skeleton (wrong shape or protocol version)")
    _, names, spec_ds, rows, inputs, outputs, keep = sk
    if not isinstance(names, list) or not isinstance(spec_ds, list) or \
            not isinstance(rows, list) or len(rows) > max_instrs or len(names) > max_instrs or \
            len(spec_ds) > max_instrs:
        raise ProtocolError(f"bad skeleton tables, or more than {max_instrs} instructions in "
                            "one tape (materialize more often: genie.materialize)")
    ops = [resolve_op(n) for n in names]
    specs = [_spec(d) for d in spec_ds]
    call_tree = [_is_call_tree(sp) for sp in specs]
    inputs, outputs, keep = (_slot_list(inputs, "input"), _slot_list(outputs, "output"),
                             _slot_list(keep, "kept"))
    live = set(inputs)
    if len(live) != len(inputs):
        raise ProtocolError("duplicate input slots")
    n_consts = len(inputs)
    templates = []
    slot_objs: dict[int, Slot] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 6:
            raise ProtocolError(f"bad instruction {i}")
        oi, si, code, outs, free, rng = row
        if type(oi) is not int or not 0 <= oi < len(ops) or type(si) is not int or \
                not -1 <= si < len(specs) or not isinstance(code, list) or type(rng) is not bool:
            raise ProtocolError(f"bad instruction {i}")
        op = ops[oi]
        if (op == UPLOAD) != (si == -1) or (op == UPLOAD and (
                code != [-1] or not isinstance(outs, list) or len(outs) != 1 or
                outs[0] is None or free != [] or rng)):
            raise ProtocolError(f"bad upload instruction {i}")
        spec = specs[si] if si >= 0 else None
        if spec is not None and not call_tree[si]:
            raise ProtocolError(f"instruction {i}: its argument tree is not (args, kwargs)")
        if spec is not None and spec.num_leaves != len(code):
            raise ProtocolError(f"instruction {i}: {len(code)} leaves for a tree of "
                                f"{spec.num_leaves}")
        leaves: list[Any] = []
        for c in code:
            if type(c) is not int or c < -1:
                raise ProtocolError(f"instruction {i}: bad leaf {c!r}")
            if c == -1:
                leaves.append(None)
                n_consts += 1
            elif c not in live:
                raise ProtocolError(f"instruction {i} reads slot {c}, which is not live")
            else:
                leaves.append(slot_objs.setdefault(c, Slot(c)))
        if not isinstance(outs, list) or not all(
                o is None or (type(o) is int and 0 <= o < (1 << 31) and o not in live)
                for o in outs):
            raise ProtocolError(f"instruction {i}: bad outputs {outs!r:.80}")
        named = [o for o in outs if o is not None]
        if len(set(named)) != len(named):
            raise ProtocolError(f"instruction {i}: an output slot named twice")
        live.update(named)
        free = _slot_list(free, "free")
        if len(set(free)) != len(free):
            raise ProtocolError(f"instruction {i}: a slot freed twice")
        if not live.issuperset(free):
            raise ProtocolError(f"instruction {i} frees a slot that is not live")
        live.difference_update(free)
        n_consts += 2 if rng else 0
        if op is graphs.GRAPH_MUT_OP:
            _written_slots(spec, leaves, i)
        checks = arg_checks(op) if op != UPLOAD else ()
        templates.append(Template(op, spec, leaves, tuple(outs), tuple(free), rng, checks))
    if not live.issuperset(outputs) or not live.issuperset(keep):
        raise ProtocolError("outputs or kept slots are not live at the end of the tape")
    # (a compiled graph's call counts as writing: what its nodes do is not in its schema)
    writes = any(t.op != UPLOAD and (t.op is graphs.GRAPH_OP or bool(policy(t.op).writes))
                 for t in templates)
    graph_calls = any(t.op is graphs.GRAPH_OP or t.op is graphs.GRAPH_MUT_OP for t in templates)
    read = set(inputs)
    made = [s for s in keep if s not in read]
    return Compiled(templates, inputs, outputs, keep, n_consts, made,
                    any(t.op == UPLOAD for t in templates), writes=writes, graph_calls=graph_calls)


def fill(c: Compiled, consts: list[Any], frames: list[Any], inputs: dict[int, Any],
         upload: Any = None) -> Tape:
    """A runnable :class:`Tape` from a compiled skeleton and one call's constants.

    ``inputs`` are the values of the input slots (resolved by the caller, which owns the store).
    Constants that are host tensors are read from ``frames``; device, dtype, layout, string and
    generator arguments are checked against the op's schema (:func:`check_args`). Memory is
    not checked here: the server vets the whole tape on meta tensors before it runs
    (:mod:`genie.remote.guard`). With ``upload`` (a function from the frame's tensor to the
    device value), upload instructions become inputs: the received frame is the value (no copy
    on the CPU).
    """
    if len(consts) != c.n_consts:
        raise ProtocolError(f"{len(consts)} constants for a skeleton that takes "
                            f"{c.n_consts}")
    k = len(c.inputs)
    instrs: list[Instr] = []
    where: dict[int, tuple[int, int]] = {}
    at_frames: list[int] = []
    ups: list[tuple[int, int]] = []
    for i, t in enumerate(c.templates):
        if upload is not None and t.op == UPLOAD:
            v = consts[k]
            where[k] = (-1, 0)
            ups.append((k, t.outs[0]))
            k += 1
            if type(v) is not FrameRef or v.index >= len(frames):
                raise ProtocolError(f"instruction {i}: an upload needs a tensor frame")
            inputs[t.outs[0]] = upload(frame_tensor(frames[v.index], v, copy=False))
            continue
        leaves = []
        n = len(instrs)
        for x in t.leaves:
            if x is None:
                v = consts[k]
                where[k] = (n, len(leaves))
                k += 1
                tv = type(v)
                if tv is FrameRef:
                    at_frames.append(k - 1)
                    if v.index >= len(frames):
                        raise ProtocolError(f"tensor frame {v.index} is missing")
                    v = frame_tensor(frames[v.index], v, copy=t.op != UPLOAD)
                elif tv is MetaArg:
                    meta_arg_nbytes(v.meta)  # refuses negative strides
                    if t.op in _DTYPE_ONLY:  # x.new_ones(size) reads x's dtype alone
                        v = MetaArg(TensorMeta((), (), 0, v.meta.dtype, 0))
                elif tv is InputUpload:
                    raise ProtocolError("an input upload used as a constant")
                leaves.append(v)
            else:
                leaves.append(x)
        rng = None
        if t.rng:
            seed, off = consts[k], consts[k + 1]
            where[k] = (n, -1)
            where[k + 1] = (n, -2)
            k += 2
            if type(seed) is not int or type(off) is not int or seed < 0 or off < 0:
                raise ProtocolError(f"instruction {i}: bad random seed/offset")
            rng = (seed, off)
        if t.checks or t.op != UPLOAD and t.spec is not None and t.spec.num_leaves and \
                any(type(x) is str for x in leaves):
            args, kwargs = optree.tree_unflatten(t.spec, leaves)
            check_args(t.op, t.checks, args, kwargs, i)
        instrs.append(Instr(t.op, leaves, t.spec, t.outs, rng, t.free, uid=f"#{i}"))
    # (with ``upload``, each upload is an input: a refill reads it anew, as every call's)
    c.filled = Filled(instrs, where, at_frames, ups) if upload is not None else None
    return Tape(instrs, inputs, list(c.outputs), set(c.keep), [], {})


#: ops whose metadata-only first argument gives only its dtype (``new_*``: the result's shape is
#: the size argument's). The server takes it as a 0-dim value of that dtype, so a call's
#: structure does not move with that tensor's shape (transformers' decode step calls
#: ``attention_mask.new_ones(...)`` on a mask one longer each token: a shape class serves it),
#: and the scratch value it makes for it is one element, not the whole tensor.
_DTYPE_ONLY = frozenset(
    op for packet in (torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided,
                      torch.ops.aten.new_zeros, torch.ops.aten.new_ones, torch.ops.aten.new_full)
    for op in (getattr(packet, name) for name in packet.overloads()))


#: constant types a patch may change in place (others fill the tape anew)
_PATCHABLE = (int, float, bool, type(None))


def refill(c: Compiled, old: list[Any], consts: list[Any], changed: list[int],
           frames: list[Any], inputs: dict[int, Any], upload: Any = None) -> Tape | None:
    """:func:`fill` of a call whose constants differ from the last call's (``old``) only at
    ``changed``: the last tape's instructions patched in place (the last call's tape is not used
    again), host tensors read from this call's frames, and with ``upload`` (as :func:`fill`'s)
    each upload instruction's value too, into ``inputs`` (a prompt of a new length each call: a
    GPT-2 prefill's ~250 instructions filled anew cost ~0.6-1.2 ms, and the class key's walk of
    them ~0.3-0.5 ms more). None when a change is not a patch of a plain number (a type that
    changes, a tensor), or an upload's constant is not a tensor frame: fill anew. Checks as
    :func:`fill` does: seeds >= 0, an upload's frame as :func:`frame_tensor` checks it; the
    schema's argument checks hold unchecked (see below)."""
    f = c.filled
    if f is None or len(consts) != c.n_consts or (f.uploads and upload is None):
        return None
    n_in = len(c.inputs)
    touched: set[int] = set()
    for k in changed:
        if k < n_in:
            continue  # an input: resolved by the caller
        i, j = f.where[k]
        if i < 0:
            continue  # an upload: read below, as every call's
        a, b = old[k], consts[k]
        if type(a) is not type(b) or type(b) not in _PATCHABLE:
            return None
        touched.add(i)
    for k, _ in f.uploads:  # (as fill: ProtocolError from it when one is not a tensor frame)
        v = consts[k]
        if type(v) is not FrameRef or v.index >= len(frames):
            return None
    instrs = f.instrs
    patched = f.patched
    for i in touched:  # a patched instruction is a new object: a native program skips the
        ins = instrs[i]  # baked leaves of the very Instr it was compiled from
        instrs[i] = Instr(ins.op, list(ins.leaves), ins.spec, ins.outs, ins.rng, ins.free,
                          ins.uid, ins.where, ins.device)
    for k in changed:
        if k < n_in:
            continue
        i, j = f.where[k]
        if i < 0:
            continue
        v = consts[k]
        ins = instrs[i]
        if j >= 0:
            ins.leaves[j] = v
            patched.append((i, j))
        else:
            if type(v) is not int or v < 0:
                raise ProtocolError(f"instruction {i}: bad random seed/offset")
            seed, off = ins.rng  # type: ignore[misc]
            ins.rng = (v, off) if j == -1 else (seed, v)
    for k in f.frames:
        v = consts[k]
        if type(v) is not FrameRef:
            return None
        if v.index >= len(frames):
            raise ProtocolError(f"tensor frame {v.index} is missing")
        i, j = f.where[k]
        instrs[i].leaves[j] = frame_tensor(frames[v.index], v, copy=True)
    for k, slot in f.uploads:
        v = consts[k]
        inputs[slot] = upload(frame_tensor(frames[v.index], v, copy=False))
    # no check_args of the patched instructions: its verdict depends only on the types of the
    # values at checked positions and on list lengths, and a patch keeps every leaf's type (a
    # plain number or None) and the tree; the values it checks (devices, dtypes, layouts,
    # memory formats, strings) are never patchable, so a tape whose last fill passed passes
    # patched (its cost: ~70% of a refill, 7-40 us an MLP step's two AdamW instructions)
    return Tape(instrs, inputs, list(c.outputs), set(c.keep), [], {})
