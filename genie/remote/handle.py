"""A tensor resident in a server session, as the client holds it: below the client and its
residency bookkeeping (imports neither), so both can name it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..graph import TensorMeta

if TYPE_CHECKING:
    from .client import Client
    from .residency import Resident


class Handle:
    """A tensor resident in a server session: what ``node.values`` holds in remote mode.

    ``host`` briefly carries the downloaded value when the handle was a requested output;
    ``res`` what eviction needs to know (:class:`~genie.remote.residency.Resident`; None for a
    value never hinted).
    """

    __slots__ = ("id", "client", "meta", "host", "res", "__weakref__")

    def __init__(self, hid: int, client: Client, meta: TensorMeta | None) -> None:
        self.id = hid
        self.client = client
        self.meta = meta
        self.host: torch.Tensor | None = None
        self.res: Resident | None = None

    # the metadata of the resident tensor, as a tensor would answer (plan cache, debugging)
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._meta().shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._meta().dtype

    def stride(self) -> tuple[int, ...]:
        return self._meta().stride

    def storage_offset(self) -> int:
        return self._meta().offset

    def is_conj(self) -> bool:
        return getattr(self._meta(), "conj", False)

    def is_neg(self) -> bool:
        return getattr(self._meta(), "neg", False)

    def _meta(self) -> TensorMeta:
        if self.meta is None:
            raise AttributeError(f"{self!r} has no metadata")
        return self.meta

    def __del__(self) -> None:
        try:
            self.client._release(self.id)
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"Handle(#{self.id} on {self.client.address}" + ("" if self.client.alive else
                ", session gone: reconnect and recompute") + ")")
