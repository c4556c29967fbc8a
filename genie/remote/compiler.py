"""A session worker's compile helper: it writes the files Inductor needs, which the worker cannot.

A worker's sandbox forbids creating files (``RLIMIT_FSIZE`` 0, :func:`.worker.sandbox`), and
Inductor writes the C++ it generates and the shared library g++ builds from it; so before this
change every compiled graph (``genie::graph``) failed to compile on a server and ran op by op.
Before it confines itself (holding no session data yet), the worker forks this helper. On the
first run of a graph for a shape class, the worker sends the helper the graph's data and the
shape class (each input's shape, strides and dtype, or an int); the helper decodes the graph
again through the server's resolver (only admitted ATen ops), checks the shape class, compiles
the graph with Inductor on zero-filled inputs of those shapes (no session's data, no kernel run)
and answers ``{"ok": true}`` or ``{"error": "..."}``. A graph that takes sizes is asked for once
with ``"dyn": true``: compiled with dynamic shapes from that class (Dynamo compiles at the first
call, so that compiled code runs once, on the zeros), which the worker then reuses for the
graph's later shape classes (:func:`genie.graphs._dynamic`). The worker then compiles the same graph
itself: Inductor finds its source and library on disk and only loads them. Should anything still
need writing there, the worker's compile fails with ``File too large`` and the graph runs op by
op with a warning, as before (never a wrong value: the first run is checked against the
op-by-op oracle either way).

The helper trusts no request: the worker runs kernels and may be compromised. It reads
length-prefixed msgpack (at most :data:`MAX_REQUEST` bytes), admits graphs only through the
server's resolver, dtypes from :data:`DTYPES`, shapes and strides of non-negative ints, and inputs
of at most the session's quota in bytes (no real call has more). It has no network (where the
kernel allows, as the worker), dumps no core, and its memory (and its compiler's) is bounded by
the OS as the worker's is (``RLIMIT_DATA``); it never holds a session's tensors.

CPU servers only: on CUDA Inductor would need a CUDA context in the helper (the worker's graphs
still run op by op there, see docs/compile.md).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from .. import graphs

#: largest request the helper reads (a graph's data and its shape class), bytes
MAX_REQUEST = 64 << 20
#: dtypes an input may have, by name
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool)}
_MAX_DIMS = 16
_MAX_INT = 1 << 62

_LEN = struct.Struct("<Q")


class Helper:
    """The worker's end: :meth:`build` asks the helper to compile a graph for a shape class."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid = sock, pid

    def build(self, g: graphs.GraphData, args: list[Any], dynamic: bool = False) -> None:
        """Have the helper compile ``g`` for ``args``' shape class (raises if it could not);
        ``dynamic``: with dynamic shapes, from that class (:func:`genie.graphs._dynamic`)."""
        shape_class = [[list(a.shape), list(a.stride()), str(a.dtype).removeprefix("torch.")]
                       if isinstance(a, torch.Tensor) else a for a in args]
        req: dict[str, Any] = {"g": g.data, "in": shape_class}
        if dynamic:
            req["dyn"] = True
        _send(self.sock, req)
        reply = _recv(self.sock, MAX_REQUEST)
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            err = reply.get("error") if isinstance(reply, dict) else None
            raise RuntimeError(f"the server's compile helper failed: {err or 'no answer'}")


def start(device: str, resolve: Callable[[str], Any], max_bytes: int,
          confine: Callable[[], Any]) -> Helper | None:
    """Fork the helper (call before the worker's sandbox) and have :mod:`genie.graphs` use it
    for Inductor; None (nothing started) off CPU. ``confine`` runs first in the helper (the
    worker's: die with the worker, no network)."""
    if torch.device(device).type != "cpu":
        return None
    _same_config()
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the helper
        code = 0
        try:
            parent.close()
            _confine(confine)
            serve(child, resolve, torch.device(device), max_bytes)
        except BaseException:  # noqa: BLE001 - never return into the worker's code
            code = 1
        finally:
            os._exit(code)
    child.close()
    helper = Helper(parent, pid)
    graphs.builder = helper.build
    return helper


def _same_config() -> None:
    """Inductor settings the worker and the helper share (set before the fork): the files'
    names hash the compile command, which precompiled headers change; and no compile pool."""
    import torch._inductor.config as icfg

    icfg.cpp_cache_precompile_headers = False  # a header written at load time, on each load
    icfg.compile_threads = 1


#: bytes the helper (and the compiler it runs, which inherits the limit) may allocate beyond
#: what it had at fork and twice the session's quota (its inputs are at most the quota)
COMPILE_SLACK = 2 << 30


def _confine(confine: Callable[[], Any]) -> None:
    confine()  # the worker's: die with it, no network, memory bounded as its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def serve(sock: socket.socket, resolve: Callable[[str], Any], device: torch.device,
          max_bytes: int) -> None:
    """The helper's loop: one request, one answer, until the worker closes its end (or sends
    what is not a message); then it closes its own."""
    with sock:
        _serve(sock, resolve, device, max_bytes)


def _serve(sock: socket.socket, resolve: Callable[[str], Any], device: torch.device,
           max_bytes: int) -> None:
    while True:
        try:
            req = _recv(sock, MAX_REQUEST)
        except (OSError, ValueError):
            return
        if req is None:
            return
        try:
            build(req, resolve, device, max_bytes)
            reply: dict[str, Any] = {"ok": True}
        except Exception as e:  # noqa: BLE001 - answered, the worker falls back to op by op
            reply = {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}
        _send(sock, reply)


def build(req: Any, resolve: Callable[[str], Any], device: torch.device,
          max_bytes: int) -> None:
    """Check one request and compile its graph with Inductor (the files land on disk)."""
    if not (isinstance(req, dict) and set(req) - {"dyn"} == {"g", "in"}
            and isinstance(req["g"], bytes) and isinstance(req["in"], list)
            and req.get("dyn", True) is True):
        raise ValueError("a compile request is {'g': graph data (bytes), 'in': shape class} "
                         "and, for dynamic shapes, 'dyn': true")
    g = graphs.register(req["g"], resolve=resolve)  # the server's resolver: admitted ops only
    shape_class = req["in"]
    if len(shape_class) != len(g.kinds):
        raise ValueError(f"the graph takes {len(g.kinds)} inputs, the request gives "
                         f"{len(shape_class)}")
    args: list[Any] = []
    total = 0
    for kind, v in zip(g.kinds, shape_class):
        if kind == "i":
            if type(v) is not int or not -_MAX_INT < v < _MAX_INT:
                raise ValueError(f"input {len(args)} is an int of the graph, got {v!r:.80}")
            args.append(v)
            continue
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], list)
                and isinstance(v[1], list) and len(v[0]) == len(v[1]) <= _MAX_DIMS
                and all(type(n) is int and 0 <= n < _MAX_INT for n in v[0] + v[1])
                and v[2] in DTYPES):
            raise ValueError(f"input {len(args)}: expected [shape, strides, dtype name] of "
                             f"at most {_MAX_DIMS} dims, got {v!r:.120}")
        shape, stride, dtype = v[0], v[1], DTYPES[v[2]]
        extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        total += extent * dtype.itemsize
        if total > max_bytes:
            raise ValueError(f"the inputs hold more than the session's quota ({max_bytes} "
                             "bytes)")
        args.append(torch.zeros(extent, dtype=dtype, device=device).as_strided(shape, stride))
    try:
        with torch.no_grad():
            if req.get("dyn"):
                # Dynamo compiles at the first call: the compiled code runs once, on the zeros
                # (the worker checks its own first run against the op-by-op oracle)
                if "i" not in g.kinds:
                    raise ValueError("a dynamic-shape compilation of a graph that takes no "
                                     "sizes")
                graphs._compile_dynamic(g.module(device),
                                        options=dict(graphs._INDUCTOR_DEFAULTS))(*args)
            else:
                graphs._compile(g.module(device), args, "inductor", {})
    finally:
        graphs.forget(g.key)  # the helper keeps files, not graphs


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, limit: int) -> Any:
    """One message, or None when the other end closed; ValueError past ``limit`` bytes."""
    head = _read(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"a message of {n} bytes (at most {limit})")
    body = _read(sock, n)
    if body is None:
        return None
    return msgpack.unpackb(body, raw=False, strict_map_key=True)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
