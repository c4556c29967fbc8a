"""Lineage: what a client keeps to rebuild its server session on another server.

A session's state is a pure function of the requests that built it: the client chooses every
handle id, a tape's random ops carry their ``(seed, offset)`` as constants, and a run request
names its inputs by handle id or carries them as host frames. So a :class:`Lineage` is the log of
the state-changing requests since the last *checkpoint*, in the full form a fresh session accepts
(skeleton and all constants, never a delta against a skeleton cache the new server lacks):

- ``run`` entries: the tape's skeleton, constants and host frames. A frame is a zero-copy view of
  the host tensor it came from; the entry keeps that tensor alive and its version counter, and
  while the counter is unchanged the frame still holds the bytes that were sent;
- ``free`` entries: ids the client released (a replay frees them too, so the rebuilt session
  holds what the lost one held, no more);
- one ``put`` entry at the start after a checkpoint: the values of every live handle, downloaded
  from the server, uploaded again under the same ids;
- ``peer`` entries: values that another session of the client sent into this one, server to
  server (:mod:`genie.remote.peer`). A replay asks that session to send them again; the entry
  keeps the source values alive there until the next checkpoint (their bytes count against
  ``max_peer_bytes``).

Invariants: replaying the log in order on a fresh session recreates the same live handle ids
with the same values (bit for bit on the same device type, as the tapes and seeds are the same);
the log never holds a frame whose source tensor was written after it was sent (a written source
forces a checkpoint before the next request, while the server still holds the right values);
its replay cost (ops and held host bytes) stays under the bounds, past which a checkpoint
replaces it. A checkpoint re-uploads values one by one: resident values that shared storage on
the lost server (a view and its base) no longer do after a replay that starts at a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: default bounds on what a replay may cost before a checkpoint replaces the log
MAX_OPS = 200_000
MAX_HOST_BYTES = 1 << 30
#: values pinned on other servers for a replay (``peer`` entries): values the program may have
#: dropped (a request's prompt KV cache) stay there until a checkpoint, so the bound is lower
MAX_PEER_BYTES = 256 << 20


@dataclass(slots=True)
class RunEntry:
    """One run request in full form (its frames zero-copy views of ``sources``' memory)."""

    key: bytes
    skeleton: bytes
    consts: list[Any]
    frames: list[Any]
    id0: int
    ops: int
    sources: list[tuple[torch.Tensor, int]]  # host tensors behind the frames, with versions


@dataclass(slots=True)
class FreeEntry:
    ids: list[int]


@dataclass(slots=True)
class PutEntry:
    """A checkpoint: these values under these handle ids."""

    ids: list[int]
    values: list[torch.Tensor]


@dataclass(slots=True)
class PeerEntry:
    """Values received from the client's session ``source`` (a :class:`~genie.remote.client.
    Client`): its handle ids, this session's ids, each value's signed dtype and shape; ``pinned``
    holds the source handles, so the values stay there for a replay."""

    source: Any
    src_ids: list[int]
    ids: list[int]
    signed: list[list[Any]]
    pinned: list[Any]
    nbytes: int


@dataclass
class Lineage:
    """The replay log of one client session, bounded by checkpoints.

    Args:
        max_ops: ops the log may hold before a checkpoint replaces it.
        max_host_bytes: host bytes (frames kept alive) before a checkpoint.
    """

    max_ops: int = MAX_OPS
    max_host_bytes: int = MAX_HOST_BYTES
    max_peer_bytes: int = MAX_PEER_BYTES
    entries: list[Any] = field(default_factory=list)
    live: dict[int, None] = field(default_factory=dict)  # live handle ids, in creation order
    ops: int = 0
    host_bytes: int = 0
    peer_bytes: int = 0
    checkpoints: int = 0

    def record_run(self, entry: RunEntry, new_ids: list[int]) -> None:
        self.entries.append(entry)
        self.ops += entry.ops
        self.host_bytes += sum(_nbytes(f) for f in entry.frames)
        for i in new_ids:
            self.live[i] = None

    def record_peer(self, entry: PeerEntry) -> None:
        self.entries.append(entry)
        self.peer_bytes += entry.nbytes
        for i in entry.ids:
            self.live[i] = None

    def record_free(self, ids: list[int]) -> None:
        if ids:
            self.entries.append(FreeEntry(list(ids)))
            for i in ids:
                self.live.pop(i, None)

    def stale(self) -> bool:
        """True when the log must be replaced by a checkpoint before the next request: past a
        bound, or a host tensor behind a logged frame was written since it was sent."""
        return (self.ops > self.max_ops or self.host_bytes > self.max_host_bytes
                or self.peer_bytes > self.max_peer_bytes or self.sources_changed())

    def sources_changed(self) -> bool:
        """True when a host tensor behind a logged frame was written since it was sent."""
        for e in self.entries:
            if type(e) is RunEntry:
                for t, v in e.sources:
                    if t._version != v:
                        return True
        return False

    def checkpoint(self, ids: list[int], values: list[torch.Tensor]) -> None:
        """Replace the log by the downloaded values of the live handles ``ids``."""
        self.entries = [PutEntry(list(ids), list(values))] if ids else []
        self.live = dict.fromkeys(ids)
        self.ops = 0
        self.peer_bytes = 0
        self.host_bytes = sum(v.numel() * v.element_size() for v in values)
        self.checkpoints += 1


def host_sources(leaves_of_tape: Any) -> list[tuple[torch.Tensor, int]]:
    """The host tensors among a tape's constants, with their version counters."""
    return [(x, x._version) for x in leaves_of_tape if isinstance(x, torch.Tensor)]


def _nbytes(f: Any) -> int:
    if isinstance(f, (bytes, bytearray)):
        return len(f)
    return memoryview(f).nbytes
