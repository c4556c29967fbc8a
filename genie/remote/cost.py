"""The cost model: seconds to move bytes and to compute FLOPs, from measured rates.

Placement (where a tape runs, whether a value goes server to server) and residency (whether an
evicted value comes back by recomputing it or by sending it again) ask the same question: is it
cheaper to *transfer* ``n`` bytes over a link or to *compute* ``f`` FLOPs in ``k`` ops on a
server? :class:`CostModel` answers it with two formulas::

    transfer_s(n, src, dst) = latency_s(src, dst) + n / link_bytes_per_s(src, dst)
    compute_s(f, server, k) = k * op_s(server) + f / server_flops_per_s(server)

Endpoints are names: :data:`CLIENT` (this process) and server addresses (``tcp://host:port``).
Links are directed (uploads and downloads may differ); an unmeasured direction uses the measured
reverse one, then the prior.

**Priors** (used until something is measured; documented in docs/deployment.md, "Cost model"):
client <-> server 500 MB/s and 1 ms per round trip (CURVE on a fast LAN: the cipher bounds it,
265-521 MB/s measured on loopback); server <-> server 1.25 GB/s (10 GbE) and 0.5 ms; a CPU server
50 GFLOP/s and 20 us per op (the guarded interpreter's per-instruction cost), a CUDA server
20 TFLOP/s and 10 us per op; an unknown device the CPU figures.

**Measured** (exponential moving averages, weight :data:`ALPHA` for a new sample):

- latency from round trips that move under :data:`SMALL_BYTES`: their network time (request to
  reply, less the server's own time, which the reply reports);
- bandwidth from round trips that move at least :data:`LARGE_BYTES`:
  ``bytes / (network time - latency)``;
- FLOP rate from tapes of at least :data:`FLOP_SAMPLE` FLOPs: ``flops / (run time - ops * op_s)``
  (the run time the server reports), when ``ops * op_s`` is under half the run time;
- else per-op cost from tapes with at least :data:`OPS_SAMPLE` ops:
  ``(run time - flops / rate) / ops``, when ``flops / rate`` is under half the run time.

Clients sample a tape on every :data:`~genie.remote.client.FLOP_SAMPLE_EVERY`-th run of a
skeleton the server already has (a first run pays compiling and vetting, not compute).

**A server not yet measured** (a figure with no sample, not set) uses the mean of what was
measured on the other servers of its device type, and the prior only when none was: a pool's
servers of one type are usually one kind of machine, and comparing one server's measurement with
another's prior would favour whichever was measured faster than the prior (a CPU server measured
at 16 us per op against an idle peer still at the prior's 20 us looked 25% faster than its
twin), so placement would keep work off the unmeasured server, which then never gets measured.

A value set with ``pin=True`` (:meth:`CostModel.set_link`, :meth:`CostModel.set_compute`) is not
moved by measurements: tests and operators force a decision that way.

FLOPs of a tape (:func:`flops_of`) come from op schemas, tags and shapes, never from op names:
ops with a formula in ``torch.utils.flop_counter`` (the matmul family, convolutions, attention:
keyed by overload packet) use it on meta tensors of the arguments' shapes; ops that return views
of an input (schema ``alias_info``) cost 0; ``pointwise``-tagged ops one FLOP per output
element; ``reduction``-tagged ops one per input element; any other op one per element of its
largest input or output (copies, indexing, normalizations: an estimate that keeps memory-bound
ops from counting as free).

Example:
    >>> from genie.remote.cost import CLIENT, CostModel
    >>> m = CostModel()
    >>> m.set_device("tcp://a:1", "cpu")
    >>> m.set_link(CLIENT, "tcp://a:1", bytes_per_s=1e9, latency_s=0.0)
    >>> round(m.transfer_s(10**9, CLIENT, "tcp://a:1"), 3)
    1.0
    >>> m.choose_recompute_or_transfer(nbytes=4 << 20, flops=10**6, ops=3,
    ...                                server="tcp://a:1").kind
    'recompute'
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..planner import MetaArg, Slot
from ..semantics import flop_formula

#: the endpoint name of this process (the client) in link keys
CLIENT = "client"

#: weight of a new measurement in the moving averages
ALPHA = 0.3
#: round trips moving less than this (bytes, both ways) measure latency
SMALL_BYTES = 64 << 10
#: round trips moving at least this (bytes, both ways) measure bandwidth
LARGE_BYTES = 1 << 20
#: tapes of at least this many FLOPs measure the FLOP rate
FLOP_SAMPLE = 10**7
#: tapes under :data:`FLOP_SAMPLE` with at least this many ops measure the per-op cost
OPS_SAMPLE = 8

#: priors: (bytes per second, seconds per round trip)
CLIENT_LINK_PRIOR = (500e6, 1e-3)
PEER_LINK_PRIOR = (1.25e9, 5e-4)
#: priors by device type: (FLOP per second, seconds per op)
DEVICE_PRIORS: dict[str, tuple[float, float]] = {
    "cpu": (50e9, 20e-6),
    "cuda": (20e12, 10e-6),
}


@dataclass(slots=True)
class Link:
    """What is known of one directed link: rate, fixed cost per round trip, samples taken."""

    bytes_per_s: float
    latency_s: float
    bw_samples: int = 0
    lat_samples: int = 0
    pinned: bool = False


@dataclass(slots=True)
class Compute:
    """What is known of one server's compute: FLOP rate, cost per op, samples taken, and
    which figures were set (:meth:`CostModel.set_compute`) rather than left at the prior."""

    flops_per_s: float
    op_s: float
    device: str = "cpu"
    flop_samples: int = 0
    op_samples: int = 0
    pinned: bool = False
    flops_set: bool = False
    op_set: bool = False


@dataclass(frozen=True, slots=True)
class Work:
    """The estimated work of some instructions: FLOPs and the number of ops."""

    flops: int
    ops: int

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.ops + other.ops)


@dataclass(frozen=True, slots=True)
class Choice:
    """The outcome of :meth:`CostModel.choose_recompute_or_transfer`: ``kind`` is
    ``"recompute"`` or ``"transfer"``, with both estimates (seconds) that decided it."""

    kind: str
    recompute_s: float
    transfer_s: float

    @property
    def saved_s(self) -> float:
        """Seconds the choice saves against the other way."""
        return abs(self.recompute_s - self.transfer_s)


def _ewma(old: float, new: float, n: int) -> float:
    return new if n == 0 else (1 - ALPHA) * old + ALPHA * new


class CostModel:
    """Measured link and compute rates, with documented priors (see the module docstring).

    Thread-safe: clients of several servers update one model.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], Link] = {}
        self._compute: dict[str, Compute] = {}

    # --- what is known --------------------------------------------------------------------------
    def _link(self, src: str, dst: str) -> Link:
        e = self._links.get((src, dst))
        if e is None:
            rev = self._links.get((dst, src))
            if rev is not None and (rev.bw_samples or rev.lat_samples or rev.pinned):
                return rev
            bw, lat = CLIENT_LINK_PRIOR if CLIENT in (src, dst) else PEER_LINK_PRIOR
            e = Link(bw, lat)
        return e

    def _own_link(self, src: str, dst: str) -> Link:
        e = self._links.get((src, dst))
        if e is None:
            bw, lat = CLIENT_LINK_PRIOR if CLIENT in (src, dst) else PEER_LINK_PRIOR
            e = self._links[(src, dst)] = Link(bw, lat)
        return e

    def _server(self, server: str) -> Compute:
        """``server``'s figures: measured or set, else what was measured on the other servers
        of its device type (their mean), else the prior (see the module docstring)."""
        c = self._compute.get(server)
        if c is None:
            f, o = DEVICE_PRIORS["cpu"]
            c = Compute(f, o)
        guess_f = not (c.flop_samples or c.flops_set or c.pinned)
        guess_o = not (c.op_samples or c.op_set or c.pinned)
        if not (guess_f or guess_o):
            return c
        fs, os_ = [], []
        for s, p in self._compute.items():
            if s != server and p.device == c.device:
                if guess_f and p.flop_samples:
                    fs.append(p.flops_per_s)
                if guess_o and p.op_samples:
                    os_.append(p.op_s)
        if not (fs or os_):
            return c
        return dataclasses.replace(c, flops_per_s=sum(fs) / len(fs) if fs else c.flops_per_s,
                                   op_s=sum(os_) / len(os_) if os_ else c.op_s)

    def link_bytes_per_s(self, src: str, dst: str) -> float:
        """Bytes per second from ``src`` to ``dst`` (:data:`CLIENT` or a server address)."""
        with self._lock:
            return self._link(src, dst).bytes_per_s

    def link_latency_s(self, src: str, dst: str) -> float:
        """The fixed cost of one round trip between ``src`` and ``dst``, seconds."""
        with self._lock:
            return self._link(src, dst).latency_s

    def server_flops_per_s(self, server: str) -> float:
        """FLOPs per second a tape runs at on ``server``."""
        with self._lock:
            return self._server(server).flops_per_s

    def server_op_s(self, server: str) -> float:
        """Seconds per instruction on ``server`` beyond its FLOPs (interpreter and launch)."""
        with self._lock:
            return self._server(server).op_s

    def transfer_s(self, nbytes: int, src: str, dst: str) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst`` (one round trip)."""
        with self._lock:
            e = self._link(src, dst)
            return e.latency_s + nbytes / e.bytes_per_s

    def compute_s(self, flops: int, server: str, ops: int = 0) -> float:
        """Seconds for ``server`` to run ``ops`` instructions doing ``flops`` FLOPs."""
        with self._lock:
            c = self._server(server)
            return ops * c.op_s + flops / c.flops_per_s

    def choose_recompute_or_transfer(self, *, nbytes: int, flops: int, ops: int, server: str,
                                     src: str = CLIENT, recompute_bytes: int = 0) -> Choice:
        """Whether a value of ``nbytes`` needed on ``server`` is cheaper to recompute there
        (``flops`` in ``ops`` instructions, plus ``recompute_bytes`` that the recompute itself
        must bring from ``src``) or to transfer from ``src``. Ties go to transfer (it is exact;
        a recompute's estimate is not).

        Example:
            >>> m = CostModel()
            >>> c = m.choose_recompute_or_transfer(nbytes=8, flops=10**12, ops=1, server="s")
            >>> c.kind, c.recompute_s > c.transfer_s
            ('transfer', True)
        """
        rec = self.compute_s(flops, server, ops)
        if recompute_bytes:
            rec += self.transfer_s(recompute_bytes, src, server)
        tr = self.transfer_s(nbytes, src, server)
        return Choice("recompute" if rec < tr else "transfer", rec, tr)

    # --- setting and measuring ----------------------------------------------------------------
    def set_device(self, server: str, device: str) -> None:
        """Use the prior of ``device``'s type (``cpu``, ``cuda:0``, ...) for ``server`` until
        it is measured (a server's ``hello`` says its device)."""
        kind = str(device).split(":", 1)[0]
        f, o = DEVICE_PRIORS.get(kind, DEVICE_PRIORS["cpu"])
        with self._lock:
            c = self._compute.get(server)
            if c is None:
                self._compute[server] = Compute(f, o, kind)
            elif c.device != kind and not c.pinned:
                c.device = kind
                if not c.flop_samples:
                    c.flops_per_s = f
                if not c.op_samples:
                    c.op_s = o

    def set_link(self, src: str, dst: str, *, bytes_per_s: float | None = None,
                 latency_s: float | None = None, pin: bool = True, both: bool = True) -> None:
        """Set a link's figures (both directions unless ``both=False``); pinned ones are not
        moved by measurements."""
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"[CostModel.set_link] bytes_per_s must be > 0, got {bytes_per_s}")
        if latency_s is not None and not latency_s >= 0:
            raise ValueError(f"[CostModel.set_link] latency_s must be >= 0, got {latency_s}")
        with self._lock:
            for key in ((src, dst), (dst, src)) if both else ((src, dst),):
                e = self._own_link(*key)
                if bytes_per_s is not None:
                    e.bytes_per_s = float(bytes_per_s)
                if latency_s is not None:
                    e.latency_s = float(latency_s)
                e.pinned = pin

    def set_compute(self, server: str, *, flops_per_s: float | None = None,
                    op_s: float | None = None, pin: bool = True) -> None:
        """Set a server's compute figures; pinned ones are not moved by measurements."""
        if flops_per_s is not None and not flops_per_s > 0:
            raise ValueError(f"[CostModel.set_compute] flops_per_s must be > 0, got "
                             f"{flops_per_s}")
        if op_s is not None and not op_s >= 0:
            raise ValueError(f"[CostModel.set_compute] op_s must be >= 0, got {op_s}")
        with self._lock:
            c = self._compute.get(server)
            if c is None:
                c = self._compute[server] = Compute(*DEVICE_PRIORS["cpu"])
            if flops_per_s is not None:
                c.flops_per_s = float(flops_per_s)
                c.flops_set = True
            if op_s is not None:
                c.op_s = float(op_s)
                c.op_set = True
            c.pinned = pin

    def unpin(self) -> None:
        """Let measurements move every figure again (pinned values stay until measured)."""
        with self._lock:
            for e in self._links.values():
                e.pinned = False
            for c in self._compute.values():
                c.pinned = False

    def observe_transfer(self, nbytes: int, seconds: float, src: str, dst: str) -> None:
        """Record a round trip that moved ``nbytes`` (both ways) in ``seconds`` of network
        time (the server's own time already taken out)."""
        if seconds <= 0 or nbytes < 0:
            return
        with self._lock:
            e = self._own_link(src, dst)
            if e.pinned:
                return
            if nbytes < SMALL_BYTES:
                e.latency_s = _ewma(e.latency_s, seconds, e.lat_samples)
                e.lat_samples += 1
            elif nbytes >= LARGE_BYTES:
                net = max(seconds - e.latency_s, seconds * 0.1)
                e.bytes_per_s = _ewma(e.bytes_per_s, nbytes / net, e.bw_samples)
                e.bw_samples += 1

    def observe_run(self, flops: int, ops: int, seconds: float, server: str) -> None:
        """Record that ``server`` ran ``ops`` instructions doing ``flops`` FLOPs in
        ``seconds``."""
        if seconds <= 0 or ops <= 0:
            return
        with self._lock:
            c = self._compute.get(server)
            if c is None:
                c = self._compute[server] = Compute(*DEVICE_PRIORS["cpu"])
            if c.pinned:
                return
            # a sample measures one figure when the other explains under half its time (so a
            # poor estimate of one cannot drag the other to zero)
            known = self._server(server)
            by_ops = ops * known.op_s
            by_flops = flops / known.flops_per_s
            if flops >= FLOP_SAMPLE and by_ops < 0.5 * seconds:
                c.flops_per_s = _ewma(c.flops_per_s, flops / (seconds - by_ops), c.flop_samples)
                c.flop_samples += 1
            elif ops >= OPS_SAMPLE and by_flops < 0.5 * seconds:
                c.op_s = _ewma(c.op_s, (seconds - by_flops) / ops, c.op_samples)
                c.op_samples += 1

    def snapshot(self) -> dict[str, Any]:
        """Every figure known, for logs and benchmarks."""
        with self._lock:
            return {
                "links": {f"{s}->{d}": {"bytes_per_s": e.bytes_per_s, "latency_s": e.latency_s,
                                        "samples": e.bw_samples + e.lat_samples,
                                        "pinned": e.pinned}
                          for (s, d), e in sorted(self._links.items())},
                "servers": {s: {"flops_per_s": c.flops_per_s, "op_s": c.op_s,
                                "device": c.device, "samples": c.flop_samples + c.op_samples,
                                "pinned": c.pinned}
                            for s, c in sorted(self._compute.items())},
            }

    def reset(self) -> None:
        """Forget every measurement and setting (priors again)."""
        with self._lock:
            self._links.clear()
            self._compute.clear()


_model = CostModel()


def model() -> CostModel:
    """The process's cost model: what every client measures into and placement reads."""
    return _model


# --- FLOPs from schemas, tags and shapes ------------------------------------------------------

META = torch.device("meta")
_VIEW_OPS: dict[Any, bool] = {}


def _returns_view(op: Any) -> bool:
    v = _VIEW_OPS.get(op)
    if v is None:
        v = _VIEW_OPS[op] = any(r.alias_info is not None and not r.alias_info.is_write
                                for r in op._schema.returns)
    return v


def _numel(x: Any) -> int:
    shape = getattr(x, "shape", None)
    return math.prod(shape) if shape is not None else 0


def _meta_of(x: Any) -> torch.Tensor | None:
    """A meta tensor with ``x``'s shape, strides and dtype (x: a tensor, a TensorMeta, a handle
    or a MetaArg); None when ``x`` has no tensor metadata."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META)
    m = getattr(x, "meta", x)
    shape, dtype = getattr(m, "shape", None), getattr(m, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return None
    stride = m.stride() if callable(getattr(m, "stride", None)) else getattr(m, "stride", None)
    if stride is None:
        return torch.empty(tuple(shape), dtype=dtype, device=META)
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=META)


def op_flops(op: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Estimated FLOPs of ``op(*args, **kwargs) -> out`` (meta tensors will do; see the module
    docstring for the rules).

    Example:
        >>> import torch
        >>> a = torch.empty(8, 16, device="meta"); b = torch.empty(16, 4, device="meta")
        >>> op_flops(torch.ops.aten.mm.default, (a, b), {}, torch.empty(8, 4, device="meta"))
        1024
        >>> op_flops(torch.ops.aten.relu.default, (a,), {}, a)
        128
    """
    if not isinstance(op, torch._ops.OpOverload):
        return 0
    formula = flop_formula(op)
    if formula is not None:
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that cannot read these arguments: the estimate below
            pass
    if _returns_view(op):
        return 0
    outs = [t for t in optree.tree_leaves(out, none_is_leaf=True)
            if isinstance(t, torch.Tensor)]
    n_out = sum(_numel(t) for t in outs)
    if torch.Tag.pointwise in op.tags:
        return n_out
    ins = [t for t in optree.tree_leaves((args, kwargs), none_is_leaf=True)
           if isinstance(t, torch.Tensor)]
    n_in = max((_numel(t) for t in ins), default=0)
    if torch.Tag.reduction in op.tags:
        return n_in
    if formula is not None:  # its formula failed: a contraction, count 2 per output and input
        return 2 * max(n_in, n_out)
    return max(n_in, max((_numel(t) for t in outs), default=0))


def flops_of(tape: Any, metas: Mapping[int, Any] | None = None) -> Work:
    """Estimated work of a :class:`~genie.planner.Tape` or a list of its instructions.

    Slot metadata comes from ``metas`` (slot -> a tensor, handle, or ``TensorMeta``), else from
    the tape's inputs and its nodes' recorded metadata; an output whose metadata is unknown is
    inferred by running its op on meta tensors. Uploads cost nothing here (they are transfers).

    Example:
        >>> import torch, optree
        >>> from genie.planner import Instr, Slot
        >>> args = ((Slot(0), Slot(1)), {})
        >>> spec = optree.tree_structure(args, none_is_leaf=True)
        >>> ins = Instr(torch.ops.aten.mm.default, optree.tree_leaves(args), spec, (2,), None)
        >>> flops_of([ins], {0: torch.empty(8, 16), 1: torch.empty(16, 4)})
        Work(flops=1024, ops=1)
    """
    instrs = getattr(tape, "instrs", tape)
    known: dict[int, Any] = dict(metas) if metas is not None else {}
    if metas is None and hasattr(tape, "instrs"):
        known.update(tape.inputs)
        slots = tape.slots
        for n in tape.nodes:
            for k, m in enumerate(n.metas):
                s = slots.get((n.index, k))
                if m is not None and s is not None:
                    known.setdefault(s, m)
    from torch.utils._python_dispatch import _disable_current_modes

    total, ops = 0, 0
    with _disable_current_modes(), torch.no_grad():
        for ins in _as_list(instrs):
            if not isinstance(ins.op, torch._ops.OpOverload):
                for s in ins.outs:  # an upload: its output is its host tensor's metadata
                    if s is not None and ins.leaves and isinstance(ins.leaves[0], torch.Tensor):
                        known.setdefault(s, ins.leaves[0])
                continue
            ops += 1
            total += _instr_flops(ins, known)
    return Work(total, ops)


def _as_list(instrs: Iterable[Any]) -> list[Any]:
    return instrs if isinstance(instrs, list) else list(instrs)


def _instr_flops(ins: Any, known: dict[int, Any]) -> int:

    leaves: list[Any] = []
    for x in ins.leaves:
        t = type(x)
        if t is Slot:
            m = _meta_of(known.get(x.id))
            if m is None:
                return 0  # a slot of unknown shape (a non-tensor value): no estimate
            leaves.append(m)
        elif t is MetaArg:
            leaves.append(_meta_of(x.meta))
        elif isinstance(x, torch.Tensor):
            leaves.append(_meta_of(x))
        elif isinstance(x, torch.device):
            leaves.append(META)
        else:
            leaves.append(x)
    try:
        args, kwargs = optree.tree_unflatten(ins.spec, leaves)
    except Exception:
        return 0
    outs: list[Any] = [known.get(s) if s is not None else None for s in ins.outs]
    need_infer = any(s is not None and o is None for s, o in zip(ins.outs, outs))
    out: Any
    if need_infer or not outs:
        try:
            res = ins.op(*args, **kwargs)
        except Exception:
            return 0  # no meta kernel (a data-dependent op): counted as free
        flat = optree.tree_leaves(res, none_is_leaf=True)
        for s, v in zip(ins.outs, flat):
            if s is not None and isinstance(v, torch.Tensor):
                known.setdefault(s, v)
        out = res
    else:
        mo = [_meta_of(o) if o is not None else None for o in outs]
        out = mo[0] if len(mo) == 1 else tuple(mo)
    return op_flops(ins.op, args, kwargs, out)
