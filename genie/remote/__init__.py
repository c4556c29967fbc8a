"""Remote execution: a Genie server owns the accelerator; clients send it tapes.

- :mod:`genie.remote.protocol` - the wire format (a msgpack header plus raw tensor frames; tapes as
  a cached *skeleton* plus a short list of per-call constants; never pickle);
- :mod:`genie.remote.server` - ``genie-server``: sessions, resident tensors, CURVE, limits;
- :mod:`genie.remote.client` - one ZeroMQ connection per server, handles, batched frees;
- :mod:`genie.remote.peer` - server-to-server transfers (``send``/``put``, tickets);
- :mod:`genie.remote.placement` - which server of the pool runs each tape (policies);
- :mod:`genie.remote.residency` - eviction by role under memory pressure, and restore;
- :mod:`genie.remote.cost` - the cost model (measured bandwidth and FLOP rates);
- :mod:`genie.backends.remote` - the ``remote`` backend, :func:`genie.connect`,
  :func:`genie.disconnect`.

This package's ``__init__`` holds only the error classes, so that ``import genie`` needs neither
pyzmq nor msgpack; those load when a program connects
(``pip install 'genie-remote-accelerator[remote]'``).
"""

from __future__ import annotations

from ..errors import GenieError


class RemoteError(GenieError):
    """A failure of remote execution; ``server`` is the address it concerns (None only for a
    :class:`ProtocolError` raised where no address is known)."""

    server: str | None

    def __init__(self, server: str, message: str) -> None:
        self.server = server
        super().__init__(f"[genie server {server}] {message}")


class ServerUnavailableError(RemoteError):
    """The server cannot be reached, refused us, stopped answering, or died during a request."""


class SessionLostError(RemoteError):
    """A value lived in a server session that no longer exists (server restarted, lease expired,
    or the client disconnected); it must be recomputed."""


class QuotaExceededError(RemoteError):
    """A request would take the session past the server's per-session memory quota."""


class ProtocolError(RemoteError):
    """A message that does not follow the wire format (sent or received), or that the server
    refuses (an op off its allowlist, a dtype or device it does not serve).

    The decoder and the server raise it without an address (``server`` is None and the message
    has no ``[genie server ...]`` prefix): they do not know one. The client gives its own
    (:meth:`at`, or ``server=``) where the error reaches the program.

    >>> str(ProtocolError("bad shape")), str(ProtocolError("bad shape").at("tcp://h:1"))
    ('bad shape', '[genie server tcp://h:1] bad shape')
    """

    def __init__(self, message: str, *, server: str | None = None) -> None:
        self.message = message
        if server is None:
            self.server = None
            GenieError.__init__(self, message)
        else:
            super().__init__(server, message)

    def at(self, server: str) -> ProtocolError:
        """This error, concerning ``server`` (itself when it already names an address)."""
        if self.server is not None:
            return self
        e = ProtocolError(self.message, server=server)
        e.__cause__, e.__traceback__ = self.__cause__, self.__traceback__
        return e


class RunTimeoutError(RemoteError):
    """A tape ran longer than the server's ``--max-run-seconds`` and was stopped."""


class PeerTransferError(RemoteError):
    """A server-to-server transfer failed: the destination server was unreachable, dropped the
    connection, stayed silent past the timeout, or refused the values (``server`` is the
    sending server; the message names the destination and the cause; ``refused`` is the
    destination's own refusal kind, such as ``quota``, or None)."""

    refused: str | None = None
    room: int | None = None  # bytes the destination would need freed to take the values


class PlacementError(RemoteError):
    """A placement policy cannot run a tape without breaking eager's semantics (values that
    share memory live on different servers and the tape writes them); the message says why."""


__all__ = ["PeerTransferError", "PlacementError", "ProtocolError", "QuotaExceededError",
           "RemoteError", "RunTimeoutError", "ServerUnavailableError", "SessionLostError"]
