"""Backends run a :class:`~genie.planner.Tape` on a real device (seed 002).

A backend registers by name with :func:`register_backend` (duplicates are refused), says whether
it can run at all (``is_available``) and whether it can take a given tape (``check``, returning
``None`` or the reason it cannot), and runs it. Materialization tries the backends in order
(``GENIE_BACKENDS=compiled,eager`` or :func:`set_backends`); one that cannot take a tape is
skipped with one logged warning per (backend, reason), and ``eager`` - the reference - always
closes the chain. Any other error propagates: a fallback never hides a bug.

Example:
    >>> import genie
    >>> from genie.backends import registered_backends, set_backends
    >>> "eager" in registered_backends()
    True
    >>> set_backends(["eager"])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..config import logger
from ..errors import GenieError
from ..planner import Tape


class Backend(Protocol):
    """What a backend provides. ``run`` returns the values of every slot in ``tape.keep``."""

    name: str

    def is_available(self) -> bool: ...

    def check(self, tape: Tape) -> str | None: ...

    def run(self, tape: Tape, device: torch.device) -> dict[int, Any]: ...

    # Optional: ``fetch(values) -> values``, for a backend whose values live elsewhere (handles of
    # tensors resident on a server): the materialized values as the caller gets them. See fetch.


class BackendUnsupported(GenieError):
    """Raised by a backend's ``run`` when it finds late that it cannot take the tape."""


#: called before a materialization plans (genie.executor): a backend that sent work ahead
#: without waiting reads its answer and binds what it made (genie.backends.remote.settle)
before_plan: Callable[[], None] | None = None

_registry: dict[str, Backend] = {}
_order: list[str] = []
_warned: set[tuple[str, str]] = set()


def register_backend(name: str) -> Callable[[type], type]:
    """Class decorator: register a backend under ``name`` (refuses duplicates)."""

    def deco(cls: type) -> type:
        if name in _registry:
            raise ValueError(f"a Genie backend named '{name}' is already registered "
                             f"({type(_registry[name]).__qualname__}); pick another name")
        inst = cls()
        inst.name = name
        _registry[name] = inst
        return cls

    return deco


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; an unknown name lists the registered ones."""
    _load_builtin()
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(f"unknown Genie backend '{name}'; registered: "
                         f"{', '.join(sorted(_registry))}") from None


def registered_backends() -> list[str]:
    _load_builtin()
    return sorted(_registry)


def set_backends(names: Sequence[str]) -> None:
    """Set the order in which backends are tried; ``eager`` is appended if missing."""
    for n in names:
        get_backend(n)
    _order[:] = [n for n in names]
    if "eager" not in _order:
        _order.append("eager")


def shape_generic() -> bool:
    """Whether the first backend in order runs every tape of a plan whatever its shapes
    (``shape_generic = True`` on the backend: eager, remote), so that the plan cache may serve a
    slice of new shapes from a plan of others (:func:`genie.plan_cache.plan`). A backend that
    bakes shapes in (``compiled``) gets a plan per shape instead."""
    return getattr(_registry[(_order or backend_order())[0]], "shape_generic", False)


def backend_order() -> list[str]:
    if not _order:
        set_backends([n.strip() for n in os.environ.get("GENIE_BACKENDS", "eager").split(",")
                      if n.strip()])
    return list(_order)


def run(tape: Tape, device: torch.device) -> tuple[dict[int, Any], str]:
    """Run ``tape`` on the first backend in order that takes it; returns (kept values, name)."""
    for name in backend_order():
        b = _registry[name]
        reason = None if b.is_available() else "not available on this machine"
        if reason is None:
            reason = b.check(tape)
        if reason is None:
            try:
                return b.run(tape, device), name
            except BackendUnsupported as e:
                reason = str(e)
        if name == "eager":
            raise GenieError(f"the eager backend cannot run this tape: {reason}")
        if (name, reason) not in _warned:
            _warned.add((name, reason))
            logger.warning("genie: backend '%s' skipped (%s); falling back to the next one",
                           name, reason)
    raise GenieError("no backend took the tape; the order must end with 'eager'")


def fetch(values: list[Any]) -> list[Any]:
    """Materialized values as the caller gets them: each available backend that keeps values
    elsewhere (one with a ``fetch`` method: ``remote``) turns its own into real tensors; values
    computed in this process pass through unchanged."""
    for name in _order or backend_order():  # (_order itself: no copy, once per materialization)
        b = _registry[name]
        f = getattr(b, "fetch", None)
        if f is not None and b.is_available():
            values = f(values)
    return values


def _load_builtin() -> None:
    from . import compiled, eager  # noqa: F401  (registration side effect)
