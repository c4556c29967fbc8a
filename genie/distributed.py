"""A ``torch.distributed`` backend for ``remote_accelerator``: collectives over host copies (gloo).

Registered as backend ``"genie"`` for the ``remote_accelerator`` and ``cpu`` devices, so
``dist.init_process_group()`` (the accelerator's default backend), ``init_process_group("genie")``
or ``"cpu:gloo,remote_accelerator:genie"`` all work, and ``DistributedDataParallel`` of a model on
the device runs unchanged.

How a collective runs: the lazy inputs are materialized and downloaded (one materialization for
all tensors of the call), gloo runs the collective on the host copies, and the results are
uploaded back into the same lazy tensors (recorded ``copy_`` nodes: in-place, as NCCL writes its
buffers). CPU tensors go to gloo directly. Collectives complete before they return (the Work is
already finished), which keeps the order of collectives identical on every rank.

What this means per real device: embedded CPU: gloo on the values themselves (a copy each way).
Server-backed devices: every collective downloads the values from the server and uploads the
results (two transfers of the gradient bytes per step), the price of keeping servers unaware of
each other. A CUDA real device would be served better by NCCL on the real tensors; that path is
not built (no GPU to test it here): with CUDA, this backend still goes through the host.

Invariants: the backend never records anything except the ``copy_`` of results; a rank's inputs
are read after every pending write to them (materialization follows storage writes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .lazy_tensor import materialize

_registered = False


def _is_lazy(t: torch.Tensor) -> bool:
    return t.device.type == "remote_accelerator"


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:

    lazy = [t for t in tensors if _is_lazy(t)]
    if lazy:
        reals = materialize(*lazy)
        if len(lazy) == 1:
            reals = (reals,)
        it = iter(reals)
    return [next(it).detach().to("cpu", copy=True).contiguous() if _is_lazy(t) else t
            for t in tensors]


def _back(dst: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, h in zip(dst, host):
            if d is not h:
                d.copy_(h)


def _done(result: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class GenieProcessGroup(dist.ProcessGroup):
    """Collectives on ``remote_accelerator`` tensors through gloo on host copies."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 (the c10d spelling)
        return "genie"

    def _wait(self, work: Any) -> None:
        work.wait()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        host = _to_host(list(tensors))
        self._wait(self.gloo.allreduce(host, opts or dist.AllreduceOptions()))
        _back(tensors, host)
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        host = _to_host(list(tensors))
        self._wait(self.gloo.allreduce_coalesced(host, opts or dist.AllreduceCoalescedOptions()))
        _back(tensors, host)
        return _done(list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        host = _to_host(list(tensors))
        self._wait(self.gloo.broadcast(host, opts or dist.BroadcastOptions()))
        _back(tensors, host)
        return _done(list(tensors))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Any:
        host_in = _to_host(list(inputs))
        host_out = [[torch.empty(o.shape, dtype=o.dtype) for o in outs] for outs in outputs]
        self._wait(self.gloo.allgather(host_out, host_in, opts or dist.AllgatherOptions()))
        for outs, hs in zip(outputs, host_out):
            _back(outs, hs)
        return _done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Any:
        (h_in,) = _to_host([input])
        h_out = torch.empty(output.shape, dtype=output.dtype)
        self._wait(self.gloo._allgather_base(h_out, h_in, opts or dist.AllgatherOptions()))
        _back([output], [h_out])
        return _done([output])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        # gloo has no reduce_scatter: an allreduce of each input list, then the own slice
        for out, ins in zip(outputs, inputs):
            host = _to_host(list(ins))
            for h in host:
                self._wait(self.gloo.allreduce([h], dist.AllreduceOptions()))
            _back([out], [host[self.rank()]])
        return _done(outputs)

    def barrier(self, opts: Any = None) -> Any:
        self._wait(self.gloo.barrier(opts or dist.BarrierOptions()))
        return _done([])


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> GenieProcessGroup:
    return GenieProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register backend ``"genie"`` for ``remote_accelerator`` (idempotent)."""
    global _registered
    if _registered or not dist.is_available():
        return
    if "genie" not in dist.Backend.backend_list:
        dist.Backend.register_backend("genie", _create, devices=["remote_accelerator"])
    _registered = True
